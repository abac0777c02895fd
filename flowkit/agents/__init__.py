"""Agentic episodes: environments, tools and the token-in/token-out episode runner (docs/guides/agents.md).

Layer: above ``llm``/``data`` (it drives rollout engines and reads bundled data), below ``rewards`` and the RL step,
which will train on its :class:`~flowkit.agents.trajectory.Trajectory` rows. No Lightning.
"""

from flowkit.agents import envs  # registers the bundled environments
from flowkit.agents.environment import ENVIRONMENTS, EnvStep, Environment, register_environment
from flowkit.agents.episode import Sample
from flowkit.agents.runner import EpisodeOptions, EpisodeRunner, engine_generate
from flowkit.agents.tools import TOOL_CALL_PARSERS, register_tool_call_parser, tool_schema
from flowkit.agents.trajectory import Trajectory, Turn, episode_metrics

__all__ = ["ENVIRONMENTS", "EnvStep", "Environment", "EpisodeOptions", "EpisodeRunner", "Sample",
           "TOOL_CALL_PARSERS", "Trajectory", "Turn", "engine_generate", "envs", "episode_metrics",
           "register_environment", "register_tool_call_parser", "tool_schema"]
