"""How often a policy succeeds at a bundled episode task, measured the way RL samples it: episodes of the real
environment and tools through the :class:`~flowkit.agents.runner.EpisodeRunner` over the ``hf`` engine's token-in
path, at the sampling temperature.

A task (:data:`EPISODE_TASKS`, by environment name) fixes the episode bounds, the new tokens a turn may take and the
records of each split. ``scripts/make_tiny_tool_adder.py`` and ``scripts/make_tiny_guesser.py`` stop their SFT on
:func:`episode_success` over ``val``; ``scripts/eval_episodes.py`` measures any checkpoint on ``test``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flowkit.agents.envs.guess_number import guess_number_records
from flowkit.agents.envs.long_addition import long_addition_records
from flowkit.agents.runner import EpisodeOptions, EpisodeRunner, engine_generate
from flowkit.agents.trajectory import episode_metrics
from flowkit.llm.hf_engine import HFRolloutEngine

# Held out by seed: the games are draws of a secret from 1-100, so a split is a stream of draws, not a set of secrets.
GUESS_SPLITS = {"train": (0, 4000), "val": (1, 500), "test": (2, 500)}
# Long enough for every live episode to join each generate call: the calls' batches, and so the samples a seed
# draws, do not depend on which worker thread finished first.
DETERMINISTIC_BATCH_WINDOW = 60.0


def guess_split(split: str) -> list[dict[str, int]]:
    """The guessing games of ``split`` (train, val, test): :data:`GUESS_SPLITS`' seed and count."""
    seed, count = GUESS_SPLITS[split]
    return guess_number_records(count, seed=seed)


@dataclass(frozen=True)
class EpisodeTask:
    """A bundled task: its episodes' options, the new tokens one turn may take, and its records by split."""

    options: EpisodeOptions
    turn_tokens: int
    records: Callable[[str], list[dict[str, Any]]]


EPISODE_TASKS = {
    # three-digit operands (k = 3): three add calls of <= 58 tokens each, then the boxed sum; ~230 tokens in all
    "long_addition": EpisodeTask(EpisodeOptions("long_addition", max_turns=6, max_tokens=320), 64,
                                 long_addition_records),
    # 1-100 in 7 guesses (binary search's worst case); a guess is \boxed{n}<eos>
    "guess_number": EpisodeTask(EpisodeOptions("guess_number", max_turns=7, max_tokens=256), 16, guess_split),
}


@torch.no_grad()
def episode_success(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: EpisodeTask,
                    records: list[dict[str, Any]], samples: int = 1, temperature: float = 1.0,
                    seed: int = 0) -> dict[str, float]:
    """:func:`~flowkit.agents.trajectory.episode_metrics` of ``samples`` episodes per record at ``temperature`` (0:
    greedy) after ``torch.manual_seed(seed)``, plus ``episodes/pass@{samples}``: the fraction of records with a
    successful episode (a GRPO group of that size with a success in it). ``episodes/success_rate`` is pass@1."""
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=task.turn_tokens, temperature=temperature)
    options = dataclasses.replace(task.options, batch_window=DETERMINISTIC_BATCH_WINDOW)
    runner = EpisodeRunner(engine_generate(engine), tokenizer, options)
    torch.manual_seed(seed)
    trajectories = runner.run([record for record in records for _ in range(samples)])
    metrics = episode_metrics(trajectories)
    wins = torch.tensor([t.done and t.final_reward > 0 for t in trajectories], dtype=torch.float)
    metrics[f"episodes/pass@{samples}"] = wins.view(len(records), samples).amax(dim=1).mean().item()
    return metrics
