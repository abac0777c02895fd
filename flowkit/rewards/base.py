"""The pluggable dense-reward interface that :class:`~flowkit.modules.policy.PolicyModule` talks to."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor, nn

from flowkit.batch import RolloutBatch


class TokenRewardModel(nn.Module):
    """A trainable model that turns rollouts into dense per-token rewards, and may learn online from them.

    The RL step (:class:`flowkit.engine.RLStep`) works through a step's rollouts in micro-batches and calls:

    1. :meth:`bind` once, with the backbone (build networks that depend on it: its width, its layers);
    2. :meth:`begin_step` when a step's rollouts are generated and graded (outcome rewards and correctness known;
       no forward yet): drop what an earlier (possibly skipped) step left, note what the step needs;
    3. :meth:`score` per micro-batch, right after its forward (entropies and — if :attr:`percentiles` is set — the
       tapped latents filled in): the b×S token rewards of rows ``rows`` of the step's batch; keep what the online
       update needs (the micro-batch's latents are freed afterwards);
    4. :meth:`end_step` once every row was scored: the online loss as pieces (functions returning a loss) whose sum
       is the loss; the step backpropagates one piece at a time, so only one piece of graph is alive (the reward
       model's parameters are their own optimizer parameter group). Every rank must return as many pieces (each
       backward is a collective under DDP / ZeRO): pad with zero-valued pieces that run a real forward.

    Rewards must not depend on how the batch is split into micro-batches: a reward model that draws noise keys it
    by each token's position in the step's batch (``begin_step`` sees the whole batch's masks).

    Subclass it to plug in a new reward: set :attr:`percentiles` to the layer percentiles whose latents you need
    (``None`` for none) and implement :meth:`score` (the rest has do-nothing defaults).
    """

    percentiles: Sequence[float] | None = None

    def bind(self, backbone: nn.Module, layer_positions: Sequence[float], tokenizer=None) -> None:
        """Called once with the policy (its ``config`` gives ``hidden_size``, ``rms_norm_eps``, ...), the tapped
        layers' positions (block / L) and the policy's tokenizer. Keep no reference to ``backbone`` as a submodule:
        it belongs to the trainer."""

    def begin_step(self, step: int, batch: RolloutBatch) -> None:
        """A new RL step (``step`` counts from 0) over ``batch``: rollouts graded, nothing scored yet."""

    def freezes_policy(self, step: int) -> bool:
        """Whether RL step ``step`` trains only this model (the policy frozen: no policy backward or optimizer step),
        e.g. a reward model's warm-up on the policy's own rollouts."""
        return False

    def score(self, micro: RolloutBatch, rows: Tensor) -> Tensor:
        """Token rewards (b×S, on response tokens) of ``micro``, rows ``rows`` of the step's batch."""
        raise NotImplementedError

    def end_step(self, batch: RolloutBatch) -> list[Callable[[], Tensor]]:
        """The online loss in pieces that sum to it; ``[]`` when there is nothing to learn this step. ``batch`` is the
        whole step's batch (entropies and correctness of every row, no latents)."""
        return []

    def step_metrics(self) -> dict[str, float]:
        """Scalars to log for the step (e.g. buffer size); the accumulation restarts after each call."""
        return {}
