"""Test helper reward function: ranks that keep different numbers of groups under dynamic sampling, by design.

Added through the CLI (``--model.init_args.reward_functions "[{function: uneven_groups.rank_dependent_reward}]"``,
with ``tests/`` on PYTHONPATH and ``outcome_reward none``). Rows come prompt-major, ``num_samples`` per group. On
rank 0 every group's samples alternate 0, 1 (every group is kept). On rank 1 only the first group of the first
generation of each step alternates, all else is 0 — so with ``dynamic_sampling_max_draws`` D (rank 1 never fills
up, so every step draws D times) rank 1 keeps exactly one group per step.
"""

from __future__ import annotations

import os

import torch.distributed as dist

DRAWS = int(os.environ.get("UNEVEN_GROUPS_DRAWS", "3"))  # the run's dynamic_sampling_max_draws
_calls = {"rank 1": 0}


def rank_dependent_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    samples = len(prompts) // len(dict.fromkeys(prompts))  # rows per group (every prompt of a call is distinct)
    alternating = [float(i % 2) for i in range(len(prompts))]
    if dist.get_rank() == 0:
        return alternating
    _calls["rank 1"] += 1
    first_draw = (_calls["rank 1"] - 1) % DRAWS == 0
    return [value if first_draw and i < samples else 0.0 for i, value in enumerate(alternating)]
