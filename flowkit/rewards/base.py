"""The pluggable dense-reward interface that :class:`~flowkit.modules.policy.PolicyModule` talks to."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from flowkit.batch import RolloutBatch


class TokenRewardModel(nn.Module):
    """A trainable model that turns a scored rollout batch into dense per-token rewards.

    The policy module calls, once per RL step and in this order:

    1. :meth:`bind` once, when the backbone is known (build networks that depend on its width);
    2. :meth:`token_rewards` on the batch (outcome rewards, correctness, entropy and — if
       :attr:`percentiles` is set — tapped latents are filled in) → B×S rewards on response tokens;
    3. :meth:`update_loss` → a loss to add to the policy loss (its parameters form their own optimizer
       parameter group), or ``None`` when there is nothing to learn from this step.

    Subclass it to plug in a new reward: set :attr:`percentiles` to the layer percentiles whose latents you
    need (``None`` for none) and implement the three methods.
    """

    percentiles: Sequence[float] | None = None

    def bind(self, hidden_size: int, layer_positions: Sequence[float]) -> None:
        """Called once with the backbone's hidden size and the tapped layers' positions h/L."""

    def token_rewards(self, batch: RolloutBatch, step: int) -> Tensor:
        raise NotImplementedError

    def update_loss(self, batch: RolloutBatch, step: int) -> Tensor | None:
        return None

    def step_metrics(self) -> dict[str, float]:
        """Scalars to log for the last step (e.g. buffer size)."""
        return {}
