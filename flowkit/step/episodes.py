"""Agent episodes as the rows of an RL step (docs/guides/agents.md): the episode runner over the rollout engine's
token-in path, its trajectories laid out as a :class:`~flowkit.batch.RolloutBatch`, graded with the environment's
reward.

A row is one episode, laid out as a single-turn row is: its first prompt (left-padded), then every later token as
the response — the policy's turns exactly as the engine sampled them and the environment's answers as the chat
template rendered them. ``policy_mask`` marks the policy's tokens: the loss, the estimators, the rollout
corrections and the reward model read them alone (:attr:`RolloutBatch.loss_mask
<flowkit.batch.RolloutBatch.loss_mask>`), while the forward reads every token, so the environment's condition the
policy's log-probs and latents. ``rollout_logprobs`` and per-token ``policy_versions`` come from the sampler.

With ``rollout.max_staleness`` k ≥ 1 (the ``server`` engine) the episodes run ahead of training as single-turn rows
do: the next k steps' episodes run in a thread of their own while this step trains (:meth:`EpisodeRollout.prefetch`,
one batch after another, as the engine runs its prefetches), their turns sampled from whatever weights the servers
hold by then; the step that trains a batch takes its episodes, and runs again those whose oldest policy token is more
than k versions behind its weights (counted in the engine's ``regenerated_rows``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from flowkit.agents import EpisodeOptions, EpisodeRunner, Sample, Trajectory, engine_generate, episode_metrics
from flowkit.batch import RolloutBatch, prompt_aligned
from flowkit.distributed import any_rank
from flowkit.errors import RunError
from flowkit.llm.rollout_engine import PrefetchingEngine, RolloutEngine
from flowkit.step.experience import PromptBatch


class EpisodeRollout:
    """Generates a step's rows as episodes with ``engine``'s token-in path ``generate_from_ids`` (an engine plugs
    in by implementing it: :func:`~flowkit.agents.engine_generate`); a one-line error when it has none. Over a
    :class:`~flowkit.llm.rollout_engine.PrefetchingEngine` with ``max_staleness`` ≥ 1 it is a
    :class:`~flowkit.llm.rollout_engine.Prefetcher` of prompt batches (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, options: EpisodeOptions):
        self.engine, self.sample = engine, engine_generate(engine)
        self.runner = EpisodeRunner(self._generate, tokenizer, options)
        self.tokenizer, self.options = tokenizer, options
        self.max_staleness = engine.max_staleness if isinstance(engine, PrefetchingEngine) else 0
        self._background = ThreadPoolExecutor(1, thread_name_prefix="episodes-ahead") if self.max_staleness else None
        self._pending: dict[tuple, Future] = {}
        # A prefetched run and the step's own (episodes run again) may call the engine at once: each call and the
        # non-finite flag it leaves on the engine are read together, into the flag of the run on the calling thread.
        self._engine_calls = threading.Lock()
        self._run_on_this_thread = threading.local()

    @staticmethod
    def of(engine: RolloutEngine, tokenizer: Any, options: EpisodeOptions) -> EpisodeRollout | None:
        """The episodes of ``options`` over ``engine``; None while ``options.environment`` is null (no episodes)."""
        return None if options.environment is None else EpisodeRollout(engine, tokenizer, options)

    def prefetch(self, prompts: PromptBatch, n: int) -> None:
        """Start these prompts' episodes in the background, behind the batches already started; the step that
        trains them takes them (:meth:`generate`)."""
        self._pending[_key(prompts, n)] = self._background.submit(self._run, _records(prompts, n))

    def prefetched(self, prompts: PromptBatch, n: int) -> bool:
        """Whether these prompts' episodes were started in the background (and not taken yet)."""
        return _key(prompts, n) in self._pending

    def generate(self, prompts: PromptBatch, n: int,
                 device: torch.device) -> tuple[RolloutBatch, list[Trajectory], bool]:
        """``n`` episodes per prompt (rows prompt-major, a group per prompt), each from the record ``{prompt,
        answer, **columns}``, every episode's trajectory, and whether a next-token score of theirs was not finite.
        Episodes prefetched for these prompts are taken, those more than ``max_staleness`` versions old run again.
        An episode that ended before the policy's first turn (its environment failed to start) is no row; when none
        is left, or every episode ended in a fault of the environment, :class:`~flowkit.errors.RunError` — on every
        rank (a collective: agreed before any rank goes on to the step's next collective and waits there for one
        that stopped)."""
        records, failure = _records(prompts, n), None
        try:
            trajectories, nonfinite, rows = self._episodes(records, _key(prompts, n))
        except RunError as error:
            failure = error
        if any_rank(failure is not None):
            raise failure or RunError("the episodes of another rank failed (that rank's error says why)")
        kept = [trajectories[index] for index in rows]
        batch = self._rows(kept, torch.tensor([index // n for index in rows]), device)
        batch.columns = {key: [records[index][key] for index in rows] for key in prompts.columns}
        batch.columns["episode"] = [self._summary(trajectory) for trajectory in kept]
        return batch, trajectories, nonfinite

    def _episodes(self, records: list[dict[str, Any]], key: tuple) -> tuple[list[Trajectory], bool, list[int]]:
        """The records' trajectories (prefetched under ``key`` or run now), the non-finite flag and the indices of
        those that reached the policy's first turn; :class:`~flowkit.errors.RunError` when none did, or (from the
        runner) when every episode ended in a fault of the environment."""
        prefetched = self._pending.pop(key, None)
        if prefetched is None:
            trajectories, nonfinite = self._run(records)
        else:
            trajectories, nonfinite = self._within_staleness(records, *prefetched.result())
        rows = [index for index, trajectory in enumerate(trajectories) if _reached_the_policy(trajectory)]
        if not rows:
            first = next((t.error or t.stop_reason for t in trajectories), "no episode")
            raise RunError(f"no episode of environment {self.options.environment!r} reached the policy's first turn "
                           f"(episodes.max_tokens {self.options.max_tokens} below the prompts?); the first: {first}")
        return trajectories, nonfinite, rows

    def _run(self, records: list[dict[str, Any]]) -> tuple[list[Trajectory], bool]:
        """The records' trajectories, and whether the engine saw a non-finite next-token score in any of their
        turns."""
        self._run_on_this_thread.nonfinite = False
        trajectories = self.runner.run(records, lockstep=any_rank if self.engine.lockstep else None)
        return trajectories, self._run_on_this_thread.nonfinite

    def _generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        with self._engine_calls:
            samples = self.sample(prompts, max_new_tokens)
            self._run_on_this_thread.nonfinite |= self.engine.saw_nonfinite_logits
        return samples

    def _within_staleness(self, records: list[dict[str, Any]], trajectories: list[Trajectory],
                          nonfinite: bool) -> tuple[list[Trajectory], bool]:
        """Prefetched episodes whose oldest policy token is more than ``max_staleness`` versions behind the weights
        this step trains run again from the newest weights pushed, as the engine regenerates a prefetched row."""
        stale = [index for index, trajectory in enumerate(trajectories)
                 if any(self.engine.policy_version - version > self.max_staleness
                        for version in trajectory.versions if version >= 0)]
        if not stale:
            return trajectories, nonfinite
        again, nonfinite_again = self._run([records[index] for index in stale])
        self.engine.regenerated_rows += len(stale)
        for index, trajectory in zip(stale, again, strict=True):
            trajectories[index] = trajectory
        return trajectories, nonfinite or nonfinite_again

    def grade(self, batch: RolloutBatch, trajectories: list[Trajectory]) -> dict[str, float]:
        """Adds each row's environment reward (``options.reward``) to the graded ``batch``'s outcome rewards (the
        reward functions' over the final answer) and makes ``correct`` the episode's success; returns the metrics
        of every episode, rows or not (:func:`~flowkit.agents.episode_metrics`), and the rows' mean environment
        reward."""
        device = batch.input_ids.device
        rows = [trajectory for trajectory in trajectories if _reached_the_policy(trajectory)]
        rewards = torch.tensor([t.reward(self.options.reward, self.options.reward_gamma) for t in rows])
        batch.outcome_rewards = batch.outcome_rewards.float() + rewards.to(device)
        batch.correct = torch.tensor([t.success for t in rows], device=device)
        return {**episode_metrics(trajectories), "train/reward/environment": float(rewards.mean())}

    def _rows(self, trajectories: list[Trajectory], group_ids: Tensor, device: torch.device) -> RolloutBatch:
        """The trajectories as B×S rows: the first prompt left-padded to the longest, every later token after it.
        A token the policy did not sample carries the policy version of the turn before it (the prompt, the
        first turn's), so staleness metrics read whole rows."""
        prompt_lengths = [trajectory.turns[0].end for trajectory in trajectories]
        rows = prompt_aligned([t.token_ids for t in trajectories], prompt_lengths, self.tokenizer.pad_token_id or 0)
        policy = rows.place([t.loss_mask for t in trajectories], torch.float32)
        logprobs = rows.place([t.logprobs for t in trajectories], torch.float32)
        versions = rows.place([_carried_forward(torch.tensor(t.versions)) for t in trajectories], torch.long)
        return RolloutBatch(
            input_ids=rows.input_ids.to(device), attention_mask=rows.attention_mask.to(device),
            response_mask=rows.response_mask.to(device), group_ids=group_ids.to(device),
            prompts=[self.tokenizer.decode(t.token_ids[:p], skip_special_tokens=False)
                     for t, p in zip(trajectories, prompt_lengths)],
            responses=[self._final_answer(trajectory) for trajectory in trajectories],
            answers=[str(trajectory.record["answer"]) for trajectory in trajectories],
            rollout_logprobs=logprobs.to(device), policy_versions=versions.to(device), policy_mask=policy.to(device),
            truncated=torch.tensor([trajectory.truncated for trajectory in trajectories], device=device))

    def _final_answer(self, trajectory: Trajectory) -> str:
        """The text of the policy's last turn: what the reward functions grade."""
        last = trajectory.policy_turns()[-1]
        return self.tokenizer.decode(trajectory.token_ids[last.start:last.end], skip_special_tokens=True)

    def _summary(self, trajectory: Trajectory) -> dict[str, Any]:
        """The ``episode`` column of a row: its turns after the prompt (whose, their text and token count), how it
        ended, its environment reward and counters (completion logs show it turn by turn)."""
        ids = trajectory.token_ids
        return {"turns": [{"role": turn.role, "text": self.tokenizer.decode(ids[turn.start:turn.end],
                                                                            skip_special_tokens=False),
                           "tokens": turn.end - turn.start} for turn in trajectory.turns[1:]],
                "stop_reason": trajectory.stop_reason, "error": trajectory.error,
                "environment_reward": trajectory.reward(self.options.reward, self.options.reward_gamma),
                "counters": dict(trajectory.counters)}


def _records(prompts: PromptBatch, n: int) -> list[dict[str, Any]]:
    """``n`` records per prompt, prompt-major: ``{prompt, answer, **columns}``."""
    return [{"prompt": prompt, "answer": answer, **{key: values[index] for key, values in prompts.columns.items()}}
            for index, (prompt, answer) in enumerate(zip(prompts.prompts, prompts.answers)) for _ in range(n)]


def _key(prompts: PromptBatch, n: int) -> tuple:
    return tuple(prompts.prompts), n


def _reached_the_policy(trajectory: Trajectory) -> bool:
    return any(trajectory.loss_mask)


def _carried_forward(versions: Tensor) -> Tensor:
    """Each token's version, or that of the last sampled token before it (-1: none; the tokens before the first
    sampled one take its version)."""
    sampled = versions >= 0
    index = torch.where(sampled, torch.arange(len(versions)), 0).cummax(0).values
    filled = versions[index]
    first = versions[sampled][0] if sampled.any() else torch.tensor(0)
    return torch.where(filled >= 0, filled, first)
