"""One episode in progress: its environment, the tokens so far and whose they are, its counters.

The runner calls :meth:`Episode.start` once, then :meth:`Episode.advance` with each sample the engine drew for it,
each in a worker thread and never two at once. Every fault of the environment or a tool ends in this episode: an
error observation for the model or the end of the episode, counted, never an exception out of these methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flowkit.agents.environment import EnvStep, Environment, Message, check_messages
from flowkit.agents.rendering import ChatRenderer
from flowkit.agents.tools import CallTimeout, ToolBox, ToolCallParser, call_with_timeout
from flowkit.agents.trajectory import COUNTERS, Role, StopReason, Trajectory, Turn

NOT_SAMPLED_VERSION = -1  # the policy version of a token the policy did not sample
MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Sample:
    """One turn the engine sampled: its token ids (ending with a stop id unless cut by length), each one's
    log-probability under the sampler, and the policy version whose weights drew each one."""

    ids: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int]


@dataclass(frozen=True)
class EpisodeSetup:
    """What every episode of a run shares (built once by the runner)."""

    environment: type[Environment]
    renderer: ChatRenderer
    toolbox: ToolBox
    parse: ToolCallParser
    stop_ids: frozenset[int]
    max_turns: int
    max_tokens: int
    call_timeout: float


class Episode:
    """The trajectory of one record being built (see the module docstring)."""

    def __init__(self, record: dict[str, Any], setup: EpisodeSetup):
        self.record, self.setup = record, setup
        self.environment: Environment | None = None
        self.ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turns: list[Turn] = []
        self.turn_rewards: list[float] = []
        self.final_reward = 0.0
        self.stop_reason: StopReason | None = None
        self.error: str | None = None
        self.counters = dict.fromkeys(COUNTERS, 0)

    def room(self) -> int:
        """Tokens the next turn may take within the episode's budget."""
        return self.setup.max_tokens - len(self.ids)

    def start(self) -> None:
        """Build the environment, reset it with the record and render its first messages."""
        try:
            self.environment = self.setup.environment()
            messages = call_with_timeout(self.environment.reset, self.setup.call_timeout, self.record)
            prompt = self.setup.renderer.prompt(check_messages(messages, "reset"))
        except CallTimeout as timeout:
            return self._end("env_timeout", str(timeout), "env_timeouts")
        except Exception as error:  # noqa: BLE001 - a faulty environment (or messages its template rejects), counted
            return self._end("env_error", f"reset: {type(error).__name__}: {error}", "env_errors")
        self._append(prompt, "prompt")

    def advance(self, sample: Sample) -> None:
        """Append the sampled turn as is, answer it (tools, or the environment's ``step``) and append the answer's
        rendering, or end the episode."""
        ids = list(sample.ids)[:self.room()]  # what does not fit the budget is not kept
        self._append_policy(ids, sample.logprobs, sample.versions)
        if not ids or ids[-1] not in self.setup.stop_ids:
            return self._end("max_tokens")  # the turn ran out of room (the budget or the engine's length limit)
        text = self.setup.renderer.decode(ids)
        calls = self.setup.parse(text) if self.setup.toolbox.tools else []
        answer = self._run_tools(calls) if calls else self._step(text)
        if self.stop_reason is not None:
            return
        if len(self.turn_rewards) >= self.setup.max_turns:
            return self._end("max_turns")
        try:
            delta = self.setup.renderer.delta(answer, ids[-1])
        except Exception as error:  # noqa: BLE001 - messages the chat template rejects (a role it does not know)
            return self._end("env_error", f"chat template: {type(error).__name__}: {error}", "env_errors")
        self._append(delta, "tool" if calls else "environment")

    def trajectory(self) -> Trajectory:
        return Trajectory(self.record, tuple(self.ids), tuple(self.loss_mask), tuple(self.logprobs),
                          tuple(self.versions), tuple(self.turns), tuple(self.turn_rewards), self.final_reward,
                          self.stop_reason, self.error, dict(self.counters))

    def _run_tools(self, calls: list) -> list[Message]:
        reply = self.setup.toolbox.run(calls)
        self.counters["tool_calls"] += reply.calls
        self.counters["tool_errors"] += reply.errors
        self.counters["tool_replies_truncated"] += reply.truncated
        self.counters["tool_calls_over_limit"] += reply.over_limit
        self.turn_rewards.append(0.0)
        if reply.timed_out is not None:
            self._end("tool_timeout", str(reply.timed_out), "tool_timeouts")
        return reply.messages

    def _step(self, action: str) -> list[Message]:
        try:
            step = EnvStep(*call_with_timeout(self.environment.step, self.setup.call_timeout, action))
            messages, reward = check_messages(step.messages, "step"), float(step.reward)
        except CallTimeout as timeout:
            self._end("env_timeout", str(timeout), "env_timeouts")
            return []
        except Exception as error:  # noqa: BLE001 - a faulty environment ends its episode, counted
            self._end("env_error", f"step: {type(error).__name__}: {error}", "env_errors")
            return []
        self.turn_rewards.append(reward)
        if step.done:
            self.final_reward = reward
            self._end("done")
        return messages

    def _append(self, ids: list[int], role: Role) -> None:
        """Environment-side tokens; when they leave no room for a policy token, the episode ends truncated instead."""
        if len(ids) >= self.room():
            return self._end("max_tokens")
        self._extend(ids, role, [0] * len(ids), [0.0] * len(ids), [NOT_SAMPLED_VERSION] * len(ids))

    def _append_policy(self, ids: list[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        self._extend(ids, "policy", [1] * len(ids), [float(p) for p in logprobs[:len(ids)]],
                     list(versions[:len(ids)]))

    def _extend(self, ids: list[int], role: Role, mask: list[int], logprobs: list[float],
                versions: list[int]) -> None:
        self.turns.append(Turn(role, len(self.ids), len(self.ids) + len(ids)))
        self.ids += ids
        self.loss_mask += mask
        self.logprobs += logprobs
        self.versions += versions

    def _end(self, reason: StopReason, error: str | None = None, counter: str | None = None) -> None:
        self.stop_reason = reason
        self.error = None if error is None else " ".join(error.split())[:MAX_ERROR_CHARS]  # one line, bounded
        if counter is not None:
            self.counters[counter] += 1
