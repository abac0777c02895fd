"""The pluggable dense-reward interface that :class:`~flowkit.modules.policy.PolicyModule` talks to.

A worked example that CI runs is ``examples/length_token_reward.py``. What a reward model returns is checked where
it crosses the interface (:func:`check_token_rewards`, :func:`check_reward_model`): a wrong signature, shape, dtype
or device is one line naming the method and what it must be.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

from torch import Tensor, nn

from flowkit.batch import RolloutBatch
from flowkit.errors import ConfigError, RunError


class RewardModelError(RunError):
    """A reward model broke its interface at run time (a wrong shape, dtype or device from :meth:`score`)."""


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
       model's parameters are their own optimizer parameter group, at ``PolicyModule.optim.flow_lr``). Every rank must
       return as many pieces (each backward is a collective under DDP / ZeRO): pad with zero-valued pieces that run
       a real forward;
    5. :meth:`step_metrics` after the step: scalars logged with the step (a key without a ``/`` as
       ``reward_model/<key>``; ``flowkit plot`` draws them). Generic statistics of the token rewards
       (``train/token_reward/mean``, ``std``, ``min``, ``max``, ``nonzero_frac``) are logged for every reward model.

    Rewards must not depend on how the batch is split into micro-batches: a reward model that draws noise keys it
    by each token's position in the step's batch (``begin_step`` sees the whole batch's masks). Non-finite rewards
    are handled by ``PolicyModule.optim.nonfinite`` (the step is skipped, or the run fails), like non-finite log-probs.

    Subclass it to plug in a new reward: set :attr:`percentiles` to the layer percentiles whose latents you need
    (``None`` for none) and implement :meth:`score` (the rest has do-nothing defaults).
    """

    percentiles: Sequence[float] | None = None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        score = cls.__dict__.get("score")
        if score is not None and not getattr(score, "checks_token_rewards", False):
            cls.score = _checked_score(score)

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
        """Token rewards of ``micro``, rows ``rows`` of the step's batch: a floating tensor shaped like
        ``micro.response_mask`` (b×S), on its device; only response tokens are read."""
        raise NotImplementedError

    def end_step(self, batch: RolloutBatch) -> list[Callable[[], Tensor]]:
        """The online loss in pieces that sum to it; ``[]`` when there is nothing to learn this step. ``batch`` is the
        whole step's batch (entropies and correctness of every row, no latents)."""
        return []

    def step_metrics(self) -> dict[str, float]:
        """Scalars to log for the step (e.g. buffer size); the accumulation restarts after each call."""
        return {}


def check_token_rewards(owner: str, rewards: object, micro: RolloutBatch) -> Tensor:
    """``rewards`` (what ``owner.score`` returned for ``micro``) unless it is no floating b×S tensor on ``micro``'s
    device: then a :class:`RewardModelError` naming the method and the expected shape."""
    mask = micro.response_mask
    expected = f"a floating tensor of shape {tuple(mask.shape)} (b×S, like micro.response_mask) on {mask.device}"
    if not isinstance(rewards, Tensor):
        raise RewardModelError(f"{owner}.score must return {expected}; it returned a {type(rewards).__name__}")
    if tuple(rewards.shape) != tuple(mask.shape) or not rewards.is_floating_point() or rewards.device != mask.device:
        raise RewardModelError(f"{owner}.score must return {expected}; it returned a {rewards.dtype} tensor of shape "
                               f"{tuple(rewards.shape)} on {rewards.device}")
    return rewards


def _checked_score(score: Callable) -> Callable:
    @functools.wraps(score)
    def checked(self, micro: RolloutBatch, rows: Tensor) -> Tensor:
        return check_token_rewards(type(self).__name__, score(self, micro, rows), micro)

    checked.checks_token_rewards = True
    return checked


# The methods PolicyModule calls and the arguments it passes (by position).
INTERFACE = {"bind": ("backbone", "layer_positions", "tokenizer"), "begin_step": ("step", "batch"),
             "score": ("micro", "rows"), "end_step": ("batch",), "step_metrics": ()}


def check_reward_model(model: TokenRewardModel) -> None:
    """A one-line :class:`~flowkit.errors.ConfigError` unless ``model`` implements :meth:`TokenRewardModel.score` and
    each method of the interface takes the arguments PolicyModule passes — before the backbone is bound."""
    name = type(model).__name__
    if type(model).score is TokenRewardModel.score:
        raise ConfigError(f"{name} must implement score(micro, rows) -> the b×S token rewards "
                          "(flowkit.rewards.TokenRewardModel's interface: bind, begin_step, score, end_step, "
                          "step_metrics)")
    for method, arguments in INTERFACE.items():
        bound = getattr(model, method)
        try:
            inspect.signature(bound).bind(*arguments)
        except TypeError:
            raise ConfigError(f"{name}.{method}{inspect.signature(bound)} cannot be called as "
                              f"{method}({', '.join(arguments)}) (flowkit.rewards.TokenRewardModel's interface)"
                              ) from None
