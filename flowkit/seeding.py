"""One seed for the whole run: a part left unseeded follows the global seed, a pinned part keeps its own."""

from __future__ import annotations

import torch


def run_seed(seed: int | None) -> int:
    """``seed`` when pinned on purpose, else the run's global seed.

    The global seed is the one ``seed_everything`` (the CLI's ``--seed_everything``) gave torch, so changing
    it changes the prompt order and the reward noise together with the policy's sampling.
    """
    return seed if seed is not None else torch.initial_seed() % 2**31


def flow_noise_seed(seed: int, step: int, online_loss: bool = False) -> int:
    """The seed of RL step ``step``'s flow noise: ``seed + 1000·step`` for the token rewards (so a step's rewards
    are reproducible, e.g. by ``flowkit score --step``), one more for the step's online flow loss."""
    return seed + 1000 * step + int(online_loss)
