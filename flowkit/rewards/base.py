"""The pluggable dense-reward interface that :class:`~flowkit.modules.policy.PolicyModule` talks to."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor, nn

from flowkit.batch import RolloutBatch


class TokenRewardModel(nn.Module):
    """A trainable model that turns a scored rollout batch into dense per-token rewards.

    The policy module works through an RL step's rollouts in micro-batches (rows ``[first_row, first_row + b)``
    of the step's batch) and calls:

    1. :meth:`bind` once, when the backbone is known (build networks that depend on its width);
    2. per micro-batch, right after its forward (outcome rewards, correctness, entropy and — if
       :attr:`percentiles` is set — tapped latents are filled in): :meth:`token_rewards` → b×S rewards on
       response tokens, then :meth:`observe` (keep what the online update will need; the micro-batch's
       latents are freed afterwards);
    3. once per step, when every micro-batch was seen: :meth:`update_losses` → the online loss as a list of
       pieces (functions returning a loss) whose sum is the loss; the module calls and backpropagates one piece at a
       time, so only one piece of graph is alive (its parameters form their own optimizer parameter group).

    Rewards must not depend on how the batch is split: a reward model that draws noise keys it by the global
    token index, which is ``token_offset`` plus the index inside the micro-batch (counted as
    :meth:`scored_token_counts` counts).

    Subclass it to plug in a new reward: set :attr:`percentiles` to the layer percentiles whose latents you
    need (``None`` for none) and implement :meth:`token_rewards` (the rest has do-nothing defaults).
    """

    percentiles: Sequence[float] | None = None

    def bind(self, hidden_size: int, layer_positions: Sequence[float], rms_norm_eps: float | None = None) -> None:
        """Called once with the backbone's hidden size, the tapped layers' positions and (if the backbone has one)
        its ``rms_norm_eps``."""

    def scored_token_counts(self, response_mask: Tensor) -> Tensor:
        """B: how many tokens of each row the reward scores (its noise slots); the module sums them over earlier
        rows to give each micro-batch its ``token_offset``."""
        return response_mask.bool().sum(-1)

    def token_rewards(self, batch: RolloutBatch, step: int, token_offset: int = 0) -> Tensor:
        raise NotImplementedError

    def observe(self, batch: RolloutBatch, first_row: int) -> None:
        """See a scored micro-batch (rows from ``first_row`` on) before its latents are dropped."""

    def update_losses(self, batch: RolloutBatch, step: int) -> list[Callable[[], Tensor]]:
        """The online loss in pieces, each a bounded amount of work, that sum to it; ``[]`` when there is nothing to
        learn this step. ``batch`` is the whole step's batch without latents. Every rank must return as many pieces
        (each backward is a collective under DDP / ZeRO): pad with zero-valued pieces that run a real forward."""
        return []

    def step_metrics(self) -> dict[str, float]:
        """Scalars to log for the step (e.g. buffer size); the accumulation restarts after each call."""
        return {}
