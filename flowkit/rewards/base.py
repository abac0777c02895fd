"""The pluggable dense-reward contract that :class:`~flowkit.step.RLStep` and
:class:`~flowkit.modules.policy.PolicyModule` talk to.

A reward model (:class:`TokenRewardModel`) is bound to the backbone once and, each RL step, hands out a fresh
per-step scorer (:meth:`TokenRewardModel.begin_step`) that owns everything of that step: nothing is carried on the
reward model from one step to the next unless it means to learn across steps (e.g. a buffer of rollouts).
Optional features are written as :func:`~typing.runtime_checkable` Protocols and found by ``isinstance``:

- a step scorer: :class:`StepScorer` (``score``, required), :class:`LearnsOnline` (``end_step``: the online loss),
  :class:`ReportsMetrics` (``metrics``: the step's scalars), :class:`PadsScoring` (``pad``: another rank's extra
  micro-batch);
- a reward model: :class:`PretrainsOnLatents` (offline pretraining, ``flow_pretrain.steps``),
  :class:`EvaluatesPolicy` (its own validation metrics), :class:`ExportsWeights` (``flowkit export``).

A worked example that CI runs is ``examples/correctness_probe_reward.py``. What a reward model returns is checked where
it crosses the interface (:func:`check_reward_model`, :func:`check_step_scorer`, :func:`check_token_rewards`): a
wrong signature, a missing method, a wrong shape, dtype or device is one line naming the method and what it must be.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from flowkit.batch import RolloutBatch
from flowkit.errors import ConfigError, RunError

LossPiece = Callable[[], Tensor]


class RewardModelError(RunError):
    """A reward model broke its interface at run time (no step scorer from ``begin_step``; a wrong shape, dtype or
    device from ``score``)."""


@runtime_checkable
class StepScorer(Protocol):
    """What :meth:`TokenRewardModel.begin_step` returns: one RL step's scoring, owning the step's state."""

    def score(self, micro: RolloutBatch, rows: Tensor) -> Tensor:
        """Token rewards of ``micro``, rows ``rows`` of the step's batch, right after its forward (entropies and —
        if the reward model's ``percentiles`` is set — the tapped latents P×b×S×d filled in): a floating tensor
        shaped like ``micro.response_mask`` (b×S), on its device; only response tokens are read. Keep what the
        online update needs: the micro-batch's latents are freed afterwards."""
        ...


@runtime_checkable
class PadsScoring(Protocol):
    """A step scorer whose :meth:`~StepScorer.score` runs collectives (a reward model sharded under ZeRO-3)."""

    def pad(self, micro: RolloutBatch) -> None:
        """Another rank scores a micro-batch where this rank has none (ranks hold different numbers of rows, e.g.
        under dynamic sampling): run the collectives a :meth:`~StepScorer.score` call runs, on ``micro`` (one row of
        the step, filled in like a real micro-batch), and keep nothing of it."""
        ...


@runtime_checkable
class LearnsOnline(Protocol):
    """A step scorer whose reward model learns from the step's rollouts."""

    def end_step(self, batch: RolloutBatch) -> list[LossPiece]:
        """Once every row was scored (``batch``: the whole step's, entropies and correctness of every row, no
        latents): the online loss as pieces (functions returning a loss) whose sum is the loss; ``[]`` when there
        is nothing to learn. The step backpropagates one piece at a time, so only one piece of graph is alive (the
        reward model's parameters are their own optimizer group, at ``PolicyModule.optim.flow_lr``). Every rank must
        return as many pieces (each backward is a collective under DDP / ZeRO): pad with zero-valued pieces that
        run a real forward."""
        ...


@runtime_checkable
class ReportsMetrics(Protocol):
    """A step scorer with scalars to log for its step."""

    def metrics(self) -> dict[str, float]:
        """After the step: logged with it (a key without a ``/`` as ``reward_model/<key>``; ``flowkit plot`` draws
        them). A skipped step's scorer is dropped unread."""
        ...


@runtime_checkable
class PretrainsOnLatents(Protocol):
    """A reward model trained offline on the policy's latents before RL (``PolicyModule.flow_pretrain.steps``)."""

    percentiles: Sequence[float] | None

    def pretrain_losses(self, latents: Tensor, response_mask: Tensor, generator: torch.Generator) -> list[LossPiece]:
        """The pretraining loss of latents P×B×S×d in pieces that sum to it (noise and timesteps from
        ``generator``), as many on every rank."""
        ...


@runtime_checkable
class EvaluatesPolicy(Protocol):
    """A reward model with its own validation metrics (replacing pass@k of the math grader)."""

    def evaluate(self, prompts: dict[str, list], generate: Callable) -> dict[str, tuple[float, float]]:
        """``{name: (value, weight)}`` for a validation batch; ``generate(texts, n, temperature)`` samples the
        policy."""
        ...


@runtime_checkable
class ExportsWeights(Protocol):
    """A reward model whose trained network ``flowkit export`` writes next to the policy (``flow.safetensors``)."""

    def save_field(self, path: str | Path) -> None:
        ...


class TokenRewardModel(nn.Module):
    """A trainable model that turns rollouts into dense per-token rewards, and may learn online from them.

    :class:`flowkit.step.RLStep` calls :meth:`bind` once, then per RL step :meth:`freezes_policy` and
    :meth:`begin_step`, and works through the step's rollouts in micro-batches with the :class:`StepScorer` that
    returned: ``score`` per micro-batch right after its forward, ``end_step`` once every row was scored
    (:class:`LearnsOnline`), ``metrics`` after the step (:class:`ReportsMetrics`). Generic statistics of the token
    rewards (``train/token_reward/mean``, ``std``, ``min``, ``max``, ``nonzero_frac``) are logged for every model.

    Rewards must not depend on how the batch is split into micro-batches: a reward model that draws noise keys it
    by each token's position in the step's batch (``begin_step`` sees the whole batch's masks). Non-finite rewards
    are handled by ``PolicyModule.optim.nonfinite`` (the step is skipped, or the run fails), like non-finite log-probs.

    Subclass it to plug in a new reward: set :attr:`percentiles` to the layer percentiles whose latents you need
    (``None`` for none) and implement :meth:`begin_step` (the rest has do-nothing defaults).
    """

    percentiles: Sequence[float] | None = None

    def bind(self, backbone: nn.Module, layer_positions: Sequence[float], tokenizer=None) -> None:
        """Called once with the policy (its ``config`` gives ``hidden_size``, ``rms_norm_eps``, ...), the tapped
        layers' positions (block / L) and the policy's tokenizer. Keep no reference to ``backbone`` as a submodule:
        it belongs to the trainer."""

    def begin_step(self, step: int, batch: RolloutBatch) -> StepScorer:
        """The scorer of RL step ``step`` (counts from 0) over ``batch``: rollouts graded (outcome rewards and
        correctness known), nothing scored yet."""
        raise NotImplementedError

    def freezes_policy(self, step: int) -> bool:
        """Whether RL step ``step`` trains only this model (the policy frozen: no policy backward or optimizer step),
        e.g. a reward model's warm-up on the policy's own rollouts."""
        return False


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


def check_step_scorer(model: TokenRewardModel, scorer: object) -> StepScorer:
    """``scorer`` (what ``model.begin_step`` returned) unless it has no ``score(micro, rows)``: then a
    :class:`RewardModelError` naming the method."""
    if not isinstance(scorer, StepScorer):
        raise RewardModelError(f"{type(model).__name__}.begin_step must return a step scorer with score(micro, rows) "
                               f"(flowkit.rewards.StepScorer); it returned a {type(scorer).__name__}")
    return scorer


# The methods PolicyModule and RLStep call on a reward model and the arguments they pass (by position); the
# optional capabilities' methods are checked when the model has them.
INTERFACE = {"bind": ("backbone", "layer_positions", "tokenizer"), "begin_step": ("step", "batch"),
             "freezes_policy": ("step",)}
CAPABILITIES = {PretrainsOnLatents: ("pretrain_losses", ("latents", "response_mask", "generator")),
                EvaluatesPolicy: ("evaluate", ("prompts", "generate")), ExportsWeights: ("save_field", ("path",))}


def check_reward_model(model: TokenRewardModel) -> None:
    """A one-line :class:`~flowkit.errors.ConfigError` unless ``model`` implements :meth:`TokenRewardModel.begin_step`
    and each method of the interface (and of the optional capabilities it has) takes the arguments flowkit passes —
    before the backbone is bound."""
    name = type(model).__name__
    if type(model).begin_step is TokenRewardModel.begin_step:
        raise ConfigError(f"{name} must implement begin_step(step, batch) -> a step scorer with score(micro, rows) "
                          "(flowkit.rewards.TokenRewardModel's interface: bind, begin_step, freezes_policy)")
    present = dict(call for capability, call in CAPABILITIES.items() if isinstance(model, capability))
    for method, arguments in {**INTERFACE, **present}.items():
        bound = getattr(model, method)
        try:
            inspect.signature(bound).bind(*arguments)
        except TypeError:
            raise ConfigError(f"{name}.{method}{inspect.signature(bound)} cannot be called as "
                              f"{method}({', '.join(arguments)}) (flowkit.rewards.TokenRewardModel's interface)"
                              ) from None
