"""The episode runner: many episodes at once, token-in/token-out, over any ``generate`` of token ids.

``generate(prompts, max_new_tokens)`` takes each ready episode's token ids so far and the tokens its next turn may
take (its room in the episode's budget) and returns one :class:`~flowkit.agents.episode.Sample` per prompt: the
sampled ids, their sampler log-probs and the policy version of each (:func:`engine_generate` adapts a rollout
engine's token-in path: ``hf``, ``vllm`` and ``server`` have one). The runner appends exactly those ids to the
trajectory — the policy's tokens are never decoded and encoded again — and the environment's answer as the chat
template's delta (:mod:`flowkit.agents.rendering`).

Environment and tool calls run in a thread pool while the engine generates: after each ``generate``, every episode
answers its turn in its own worker, and the next ``generate`` takes every episode whose answer is ready once the
first is and the others have had ``batch_window`` seconds to join, so an episode waits for the engine and at most
that window for the others, never for another episode's tool or environment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from flowkit.agents.environment import ENVIRONMENTS
from flowkit.agents.episode import Episode, EpisodeSetup, Sample
from flowkit.agents.rendering import ChatRenderer
from flowkit.agents.tools import TOOL_CALL_PARSERS, ToolBox
from flowkit.agents.trajectory import EpisodeReward, Trajectory
from flowkit.errors import ConfigError, RunError
from flowkit.llm.rollout_engine import RolloutEngine, check_token_in
from flowkit.options import OptionGroup, bounded, registered, registry_entry

GenerateFn = Callable[[list[list[int]], list[int]], list[Sample]]
AnyRank = Callable[[bool], bool]  # whether any rank passed True: a collective every rank calls together


@dataclass(frozen=True)
class EpisodeOptions(OptionGroup):
    """Agent episodes (docs/guides/agents.md; off while ``environment`` is null, else each row is an episode): which
    environment they run in, how the model's tool calls are read, the episodes' bounds and reward."""

    environment: str | None = registered(None, ENVIRONMENTS)
    """a name of :data:`~flowkit.agents.environment.ENVIRONMENTS` (``long_addition``, ``guess_number``,
    ``calculator_math``) or ``module.name``: the environment importing ``module`` registers; null: no episodes (one
    response per row)"""
    tool_parser: str = registered("hermes", TOOL_CALL_PARSERS)
    """how tool calls are read from the model's text: ``hermes`` (``<tool_call>{json}</tool_call>``, Qwen2.5) or
    another registered parser"""
    max_turns: int = bounded(8, 1)
    """policy turns per episode (tool calls included); an episode still going after them ends truncated"""
    max_tokens: int = bounded(4096, 2)
    """tokens per episode, prompt and every turn; a turn or an answer that does not fit ends it truncated"""
    call_timeout: float = bounded(30.0, 0, open_low=True)
    """seconds an environment's ``reset`` / ``step`` or one tool call may take; past it the episode ends (counted)"""
    max_tool_calls: int = bounded(8, 1)
    """tool calls run per turn; the model is told how many more it made, and they are counted"""
    max_tool_reply_chars: int = bounded(4096, 1)
    """characters of a tool's reply the model reads; a longer reply is cut (counted)"""
    workers: int = bounded(64, 1)
    """threads that run environment and tool calls; as many as the episodes in flight lets none wait for another"""
    reward: EpisodeReward = "final"
    """what the environment's reward of an episode is (the RL step adds its ``reward_functions`` over the final
    answer): ``final``, the reward of the step that ended it; ``turns``, every policy turn's reward summed with
    ``reward_gamma`` (Σ_k γ^k r_k)"""
    reward_gamma: float = bounded(1.0, 0, 1)
    """γ of ``reward: turns``"""
    batch_window: float = bounded(0.05, 0)
    """seconds the runner waits, once an episode is ready for its next turn, for the episodes still answering theirs
    to join the same ``generate`` call (a batched decoder takes about as long for one row as for the batch); the
    most a ready episode waits for the others, whatever their tools take. 0: generate for whoever is ready at once"""


def engine_generate(engine: RolloutEngine) -> GenerateFn:
    """The runner's ``generate`` over a rollout engine's token-in path
    (:meth:`~flowkit.llm.rollout_engine.TokenInEngine.generate_from_ids`: ``hf``, ``vllm``, ``server``), each sample
    with the policy version that sampled each token; an engine without one is a one-line
    :class:`~flowkit.errors.ConfigError` here (:func:`~flowkit.llm.rollout_engine.check_token_in`)."""
    token_in = check_token_in(engine)

    def generate(prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        rollouts = token_in.generate_from_ids(prompts, max_new_tokens)
        return [Sample(*row) for row in zip(rollouts.ids, rollouts.logprobs, rollouts.versions, strict=True)]

    return generate


class EpisodeRunner:
    """Runs a batch of records as episodes with ``generate`` (see the module docstring); ``stop_ids``: the token ids
    that end a turn (default: the tokenizer's EOS). Built before any episode runs, so a bad option, an unknown
    environment or parser, a tool without a schema or a tokenizer without a chat template is a one-line error."""

    def __init__(self, generate: GenerateFn, tokenizer: Any, options: EpisodeOptions,
                 stop_ids: Iterable[int] | None = None):
        options.check("EpisodeOptions")
        if options.environment is None:
            raise ConfigError("EpisodeOptions.environment is null: name the environment the episodes run in")
        environment = registry_entry(ENVIRONMENTS, options.environment)
        toolbox = ToolBox(tuple(getattr(environment, "tools", ())), options.call_timeout, options.max_tool_reply_chars,
                          options.max_tool_calls)
        self.generate, self.options = generate, options
        self.setup = EpisodeSetup(environment, ChatRenderer(tokenizer, toolbox.schemas), toolbox,
                                  registry_entry(TOOL_CALL_PARSERS, options.tool_parser),
                                  frozenset([tokenizer.eos_token_id] if stop_ids is None else stop_ids),
                                  options.max_turns, options.max_tokens, options.call_timeout)

    def run(self, records: list[dict[str, Any]], lockstep: AnyRank | None = None) -> list[Trajectory]:
        """One trajectory per record, in order. :class:`~flowkit.errors.RunError` when every episode ended in a
        fault of the environment or its tools (the environment cannot work as configured).

        ``lockstep`` (an engine whose ``generate`` is a collective: ``hf`` under ZeRO-3): the ranks make the same
        number of ``generate`` calls, however many turns their episodes take. Before each call they agree through it
        whether any rank still has an episode going; a rank with none ready calls ``generate`` with no prompts."""
        episodes = [Episode(record, self.setup) for record in records]
        with ThreadPoolExecutor(self.options.workers, thread_name_prefix="episode") as pool:
            in_flight = {pool.submit(episode.start): episode for episode in episodes}
            while in_flight if lockstep is None else lockstep(bool(in_flight)):
                ready = self._next_ready(in_flight) if in_flight else []
                if not ready and lockstep is None:
                    continue
                samples = self.generate([list(episode.ids) for episode in ready], [episode.room() for episode in ready])
                for episode, sample in zip(ready, self._checked(samples, len(ready)), strict=True):
                    in_flight[pool.submit(episode.advance, sample)] = episode
        trajectories = [episode.trajectory() for episode in episodes]
        self._check_environment(trajectories)
        return trajectories

    def _next_ready(self, in_flight: dict[Future, Episode]) -> list[Episode]:
        """Wait until some episode's calls are done and then up to ``batch_window`` for the rest, then take every
        episode whose calls are done: those still going."""
        wait(in_flight, return_when=FIRST_COMPLETED)
        wait(in_flight, timeout=self.options.batch_window, return_when=ALL_COMPLETED)
        ready = []
        for future in [future for future in in_flight if future.done()]:
            episode = in_flight.pop(future)
            future.result()  # the episode catches every fault of its calls; what comes out here is a bug
            if episode.stop_reason is None:
                ready.append(episode)
        return ready

    @staticmethod
    def _checked(samples: list[Sample], expected: int) -> list[Sample]:
        if len(samples) != expected:
            raise RuntimeError(f"generate returned {len(samples)} samples for {expected} prompts")
        for sample in samples:
            if not len(sample.ids) == len(sample.logprobs) == len(sample.versions):
                raise RuntimeError(f"generate returned {len(sample.ids)} ids with {len(sample.logprobs)} log-probs "
                                   f"and {len(sample.versions)} versions")
        return samples

    def _check_environment(self, trajectories: list[Trajectory]) -> None:
        faults = [trajectory.error for trajectory in trajectories if trajectory.error is not None]
        if trajectories and len(faults) == len(trajectories):
            raise RunError(f"environment {self.options.environment!r} failed in all {len(trajectories)} episodes; "
                           f"the first: {faults[0]}")
