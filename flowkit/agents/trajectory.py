"""What an episode leaves: its tokens in order, whose each one is, and how it went.

A :class:`Trajectory` is one row of the step's experience: ``token_ids`` is the sequence the trainer's forward reads,
``loss_mask`` the response mask (1 exactly on the tokens the policy sampled), ``logprobs`` and ``versions`` the
rollout log-probs and policy versions of those tokens (0 and -1 on the others), the episode's reward its outcome.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["prompt", "policy", "environment", "tool"]
# Why an episode ended: the environment said done; a bound (turns, tokens) cut it; a call faulted.
StopReason = Literal["done", "max_turns", "max_tokens", "tool_timeout", "env_timeout", "env_error"]
TRUNCATIONS = ("max_turns", "max_tokens")
EpisodeReward = Literal["final", "turns"]
COUNTERS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_replies_truncated", "tool_calls_over_limit",
            "env_errors", "env_timeouts")


@dataclass(frozen=True)
class Turn:
    """Tokens ``start:end`` of a trajectory and who wrote them: the first prompt, the policy, the environment's
    messages (a ``step``'s answer) or tool replies (each followed by the next generation prompt)."""

    role: Role
    start: int
    end: int


@dataclass(frozen=True)
class Trajectory:
    """One episode, token-in/token-out (fields all the same length: ``token_ids``, ``loss_mask``, ``logprobs``,
    ``versions``).

    ``turn_rewards`` holds one reward per policy turn (the environment's reward for the step after it; 0 after a
    tool call); ``final_reward`` is the reward of the step that ended the episode (0 when a bound or a fault ended
    it). ``error`` says which call faulted (``stop_reason`` ``tool_timeout`` / ``env_timeout`` / ``env_error``).
    ``counters`` counts tool calls and faults by kind (:data:`COUNTERS`)."""

    record: dict[str, Any]
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    turns: tuple[Turn, ...]
    turn_rewards: tuple[float, ...]
    final_reward: float
    stop_reason: StopReason
    error: str | None
    counters: dict[str, int]

    @property
    def done(self) -> bool:
        """The environment ended the episode."""
        return self.stop_reason == "done"

    @property
    def truncated(self) -> bool:
        """A bound ended it (``max_turns`` or the token budget): the step's ``mask_truncated`` and overlong penalty
        apply."""
        return self.stop_reason in TRUNCATIONS

    @property
    def success(self) -> bool:
        """The environment ended the episode with a positive reward."""
        return self.done and self.final_reward > 0

    def policy_turns(self) -> list[Turn]:
        return [turn for turn in self.turns if turn.role == "policy"]

    def reward(self, kind: EpisodeReward = "final", gamma: float = 1.0) -> float:
        """The environment's reward of the episode: ``final``, that of the step that ended it; ``turns``, the policy
        turns' rewards summed with discount ``gamma`` (Σ_k γ^k r_k)."""
        if kind == "final":
            return self.final_reward
        return sum(gamma**turn * reward for turn, reward in enumerate(self.turn_rewards))


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Summary of a batch of episodes: success rate (done with a positive final reward), policy turns per episode,
    the fraction of tool calls that were errors, the fractions done / truncated / faulted, and every counter summed
    (``episodes/<counter>``)."""
    count = max(len(trajectories), 1)
    totals = {name: sum(t.counters[name] for t in trajectories) for name in COUNTERS}
    metrics = {
        "episodes/success_rate": sum(t.success for t in trajectories) / count,
        "episodes/turns_mean": sum(len(t.policy_turns()) for t in trajectories) / count,
        "episodes/tool_error_rate": totals["tool_errors"] / max(totals["tool_calls"], 1),
        "episodes/done_rate": sum(t.done for t in trajectories) / count,
        "episodes/truncated_rate": sum(t.truncated for t in trajectories) / count,
        "episodes/fault_rate": sum(t.error is not None for t in trajectories) / count,
    }
    metrics.update({f"episodes/{name}": float(total) for name, total in totals.items()})
    return metrics
