"""`PolicyModule`: GRPO / PPO with a pluggable dense reward model (RLFR Alg. 1 when the reward is a FlowReward)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

from flowkit.batch import RolloutBatch, pad_columns
from flowkit.distributed import all_reduce_int
from flowkit.step import (
    Actor, AdvantageOptions, Experience, ExperienceMaker, Grader, KLReference, LossOptions, NonFiniteStep,
    PolicyUpdate, PromptBatch, RLStep, SamplingControls, SamplingOptions, UpdateOptions,
)
from flowkit.step.episodes import EpisodeRollout
from flowkit.step.throughput import device_peak_flops, model_flops_utilization
from flowkit.errors import ConfigError, NonFiniteTraining
from flowkit.llm.backbone import load_backbone
from flowkit.llm.engines import ROLLOUT_ENGINES, RolloutOptions
from flowkit.llm.latent_tap import LatentTap
from flowkit.llm.lora import LoraSettings, apply_lora
from flowkit.llm.rollout_engine import EngineSetup, PrefetchingEngine, RolloutEngine, rollout_metrics
from flowkit.modules.optim import require_fp32_master_weights
from flowkit.modules.policy_checkpoints import (
    REWARD_MODEL_KEY, apply_configured_lr, check_resume, reward_model_settings,
)
from flowkit.modules.policy_optimizer import LightningOptimizer
from flowkit.modules.policy_optimizers import build_optimizer, pretrain_reward_model, pretrain_unless_resuming
from flowkit.modules.policy_options import (
    MOVED_OPTIONS, EpisodeOptions, FlowPretrainOptions, OptimOptions, SFTOptions, ValidationOptions, check_options,
)
from flowkit.modules.policy_validation import PolicyValidator
from flowkit.modules.step_guard import StepGuard
from flowkit.modules.sft import supervised_start
from flowkit.options import registry_entry
from flowkit.rewards.base import ExportsWeights, TokenRewardModel, check_reward_model
from flowkit.rewards.functions import OutcomeReward, build_reward_functions
from flowkit.rl.advantages import ESTIMATORS
from flowkit.strategies import accumulate_until_step, whole_weights_for_generation

OWNER = "PolicyModule"


class PolicyModule(L.LightningModule):
    """Train a causal LM with GRPO (or PPO) on verifier rewards, shaped by a dense :class:`TokenRewardModel`.

    One RL step (one prompt batch of this rank, :class:`flowkit.step.RLStep`): sample ``sampling.num_samples``
    responses per prompt → grade them → advantages (``advantage.estimator``) from the outcome and the reward model's
    token rewards → ``update.ppo_epochs × update.num_minibatches`` updates of ``loss.policy_loss``. The reward
    model's online loss (e.g. the flow update on rejection-sampled rollouts) joins the first update; policy, reward model and
    value head are parameter groups of one optimizer (``optim``), driven through a
    :class:`~flowkit.modules.policy_optimizer.LightningOptimizer`. This module builds the rollout engine and the
    step and owns the Lightning hooks, logging and export; its parts are members: the finite-state guard
    (:attr:`guard`, a :class:`~flowkit.modules.step_guard.StepGuard`) and validation (:attr:`validator`, a
    :class:`~flowkit.modules.policy_validation.PolicyValidator`); the checkpoint checks, the optimizer and the offline
    start are functions (:mod:`~flowkit.modules.policy_checkpoints`, :mod:`~flowkit.modules.policy_optimizers`).

    Memory is set by ``update.micro_batch_size`` / ``update.micro_batch_tokens``, not by the batch: every pass over
    the rollouts runs in micro-batches, log-probs come from the LM head in chunks of response tokens (never B×S×V
    logits), the flow rewards of a micro-batch are computed right after its forward, and only the latents of rollouts
    the online flow update may use are kept (on CPU).

    Every option group (``sampling``, ``advantage``, ...) is a dataclass whose fields declare each option once, with
    its help (:mod:`flowkit.modules.policy_options`); a config sets them as nested keys
    (``model.init_args.sampling.temperature``). :data:`~flowkit.modules.policy_options.MOVED_OPTIONS` names the new
    key of every option of the old flat form.

    Args:
        backbone: hub id, local dir, or ``bundled:tiny_adder``.
        dtype: parameter dtype of the backbone: ``bfloat16`` for real models under DeepSpeed (fp32 master copies);
            elsewhere ``float32`` with ``precision: bf16-mixed`` (bf16 weights there are a ConfigError).
        trust_remote_code: passed to ``from_pretrained``; off unless you trust the model repo.
        lora: LoRA settings (peft); ``None`` fine-tunes all weights.
        gradient_checkpointing: recompute the decoder's activations in the backward (HF gradient checkpointing), for
            long rollouts of large models.
        reward_model: dense reward (e.g. :class:`~flowkit.rewards.FlowReward`); ``None`` is plain GRPO.
        outcome_reward: the math grader's reward: ``official`` (1 correct, 0.5 wrong but boxed, 0 otherwise),
            ``binary`` (1 correct, else 0) or ``none`` (only ``reward_functions``; accuracy is still graded).
        reward_functions: TRL-style reward functions ``f(prompts, completions, **columns) -> list[float]`` added to
            the grader's reward with weights, ``[{function: dotted.path | class_path: ..., init_args: {...},
            weight: w}]`` (:mod:`flowkit.rewards.functions`); each one's mean is logged as ``train/reward/<name>``.
        grader_timeout: seconds allowed to grade one response.
        sampling: the training rollouts' sampling.
        advantage: the advantage estimator.
        loss: the policy loss, KL and value loss.
        update: updates per generation and the micro-batching of every pass.
        optim: learning rates, clipping and the non-finite policy.
        controls: DAPO's sampling controls (dynamic sampling, truncated-completion mask, overlong buffer).
        rollout: the rollout engine and its settings.
        flow_pretrain: the offline start of the reward model.
        validation: validation's sampling.
        sft: an SFT start before RL.
        episodes: each row an agent episode in ``episodes.environment`` (docs/guides/agents.md), rewarded by it
            and ``reward_functions`` (``outcome_reward: none``); environment null (the default): one response per row.
        peak_flops: the device's peak FLOP/s for ``perf/mfu`` (6·N·tokens / step time / peak); None: the dense bf16
            peak of the CUDA device from :data:`flowkit.step.throughput.DEVICE_PEAK_FLOPS` (vendor datasheets),
            and no ``perf/mfu`` on a CPU or an unknown GPU.
    """

    MOVED_OPTIONS = MOVED_OPTIONS  # the CLI names the new key of an option of the old flat form

    def __init__(
        self,
        backbone: str = "bundled:tiny_adder",
        dtype: str = "float32",
        trust_remote_code: bool = False,
        lora: LoraSettings | None = None,
        gradient_checkpointing: bool = False,
        reward_model: TokenRewardModel | None = None,
        outcome_reward: OutcomeReward = "official",
        reward_functions: list[dict[str, Any]] | None = None,
        grader_timeout: float = 1.0,
        sampling: SamplingOptions = SamplingOptions(),
        advantage: AdvantageOptions = AdvantageOptions(),
        loss: LossOptions = LossOptions(),
        update: UpdateOptions = UpdateOptions(),
        optim: OptimOptions = OptimOptions(),
        controls: SamplingControls = SamplingControls(),
        rollout: RolloutOptions = RolloutOptions(),
        flow_pretrain: FlowPretrainOptions = FlowPretrainOptions(),
        validation: ValidationOptions = ValidationOptions(),
        sft: SFTOptions = SFTOptions(),
        episodes: EpisodeOptions = EpisodeOptions(),
        peak_flops: float | None = None,
    ):
        super().__init__()
        check_options(OWNER, reward_model, outcome_reward, grader_timeout, peak_flops, lora, dict(
            sampling=sampling, advantage=advantage, loss=loss, update=update, optim=optim, controls=controls,
            rollout=rollout, flow_pretrain=flow_pretrain, validation=validation, sft=sft, episodes=episodes))
        self.sampling, self.advantage, self.optim, self.controls = sampling, advantage, optim, controls
        self.rollout, self.flow_pretrain, self.validation, self.sft = rollout, flow_pretrain, validation, sft
        self.episodes = episodes
        self.loss_options = loss.with_budget(sampling.max_new_tokens)
        self.update = update.at_temperature(sampling.temperature)
        self.save_hyperparameters(ignore=["reward_model"])
        self.automatic_optimization = False
        self.reward_functions = build_reward_functions(reward_functions)
        if outcome_reward == "none" and not self.reward_functions and reward_model is None and not episodes.environment:
            raise ConfigError(f"{OWNER}.outcome_reward 'none' needs a reward_model, episodes or at least one "
                              "entry in reward_functions")
        self.policy, self.tokenizer = load_backbone(backbone, dtype, trust_remote_code)
        self.policy.train()  # from_pretrained returns eval mode; RL trains in train mode, as after flow pretraining
        self.reference = None  # the frozen initial policy of the KL, without LoRA (a checkpoint key)
        if loss.kl_coef > 0 and lora is None:
            self.reference, _ = load_backbone(backbone, dtype, trust_remote_code)
        if lora is not None:
            self.policy = apply_lora(self.policy, lora)
        if gradient_checkpointing:
            # newer transformers name it activation_checkpointing_enable (the old name warns); older ones lack it
            getattr(self.policy, "activation_checkpointing_enable", self.policy.gradient_checkpointing_enable)(
                {"use_reentrant": False})
        self.value_head = (torch.nn.Linear(self.policy.config.hidden_size, 1)
                           if registry_entry(ESTIMATORS, advantage.estimator).value_head else None)
        self.reward_model = reward_model
        self.tap = None
        if reward_model is not None and reward_model.percentiles:
            self.tap = LatentTap(self.policy, reward_model.percentiles)
        if reward_model is not None:
            check_reward_model(reward_model)
            reward_model.bind(self.policy, self.tap.layer_positions if self.tap is not None else [], self.tokenizer)
        self.guard = StepGuard(optim)
        self._build_step(backbone, loss.kl_coef > 0)
        self.sft_losses: list[float] = []
        self.validator = PolicyValidator(validation, grader_timeout)

    def _build_step(self, backbone: str, with_kl: bool) -> None:
        """The rollout engine, the actor and the RL step."""
        sampling, rollout = self.sampling, self.rollout
        self.rollout_engine: RolloutEngine = registry_entry(ROLLOUT_ENGINES, rollout.engine).build(EngineSetup(
            self.policy, self.tokenizer, backbone, sampling.max_new_tokens, sampling.temperature, sampling.top_p,
            rollout, whole_weights=lambda: whole_weights_for_generation(self._trainer, self.policy)))
        if rollout.max_staleness and not isinstance(self.rollout_engine, PrefetchingEngine):
            raise ConfigError(f"{OWNER}.rollout.max_staleness {rollout.max_staleness} needs a rollout engine that "
                              f"generates apart from training (rollout.engine: server), not {rollout.engine!r}")
        # after an SFT start, PPO's reference is the post-SFT policy: a snapshot (a frozen adapter under LoRA)
        reference = KLReference(self.policy, self.reference, snapshot_adapter=self.sft.epochs > 0) if with_kl else None
        self.actor = Actor(self.policy, self.tap, self.value_head, reference, self.update, self.loss_options)
        grader = Grader(self.hparams.outcome_reward, self.reward_functions, self.hparams.grader_timeout)
        experience = ExperienceMaker(self.actor, self.rollout_engine, grader, self.reward_model, self.advantage,
                                     self.update, self.controls, sampling.num_samples, stream=DataModulePrompts(self),
                                     episodes=EpisodeRollout.of(self.rollout_engine, self.tokenizer, self.episodes))
        self.rl_step = RLStep(experience, PolicyUpdate(self.actor, self.update))

    def step_optimizer(self, learning_rates: Callable[[int], dict[str, float]] | None = None) -> LightningOptimizer:
        """An RL step's (and the SFT start's) optimizer object; ``learning_rates(step)``: the groups' rates that differ
        from their own at a step (default: the config's warmup)."""
        return LightningOptimizer(self, self.guard, self.optim.max_grad_norm, learning_rates or self.optim.warmup_rates)

    # ----------------------------------------------------------------------------------------- training
    def setup(self, stage: str) -> None:
        if stage == "fit":
            require_fp32_master_weights(OWNER, self.trainer.strategy, self, self.optim.lr)
            accumulate_until_step(self.trainer, self.optim.max_grad_norm)

    def on_fit_start(self) -> None:
        """The SFT start (``sft.epochs``), once, before the first RL step; then the KL reference becomes the SFT'd
        policy (a resumed run restores both from its checkpoint)."""
        if self.sft.epochs and self.global_step == 0:
            self.sft_losses = supervised_start(self, self.sft.epochs, self.sft.lr)
            if self.actor.reference is not None:
                self.actor.reference.snapshot()

    def on_train_start(self) -> None:
        """Training starts, fresh or resumed: the config's learning rates apply (:func:`apply_configured_lr`);
        non-finite weights (a flow file or checkpoint holding NaN, a diverged pretraining), which would only skip
        every step, stop the run in one line; the engine learns of the weights training starts from (after an SFT
        start; resumed: restored by now, at version ``global_step``)."""
        apply_configured_lr(self.optimizers().optimizer.param_groups, self.optim, self.global_step)
        self._check_finite_weights("at the start of training")
        self.rollout_engine.sync_weights(self.policy, self.global_step)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """``rollout.max_staleness`` k ≥ 1: the engine generates the next k steps' rollouts (or runs their episodes)
        while this one trains (:meth:`~flowkit.step.ExperienceMaker.prefetch_ahead`, batches of a
        :class:`~flowkit.modules.datamodule.PromptStream`); a resumed run restarts the pipeline from its first step, no
        step's prompts lost or generated twice."""
        stream = getattr(self.trainer.train_dataloader, "dataset", None)
        if isinstance(self.rollout_engine, PrefetchingEngine) and hasattr(stream, "batch") and "index" in batch:
            steps_after = (math.ceil((self.trainer.max_steps - self.global_step) / self.update.updates) - 1
                           if self.trainer.max_steps >= 0 else self.rollout.max_staleness)
            self.rl_step.experience.prefetch_ahead(stream.batch, int(batch["index"]), steps_after)

    def training_step(self, prompts: dict[str, Any], batch_idx: int) -> None:
        start = time.perf_counter()
        try:
            experience, stats = self.rl_step(PromptBatch.of(prompts), int(prompts["index"]), self.step_optimizer())
        except NonFiniteStep as bad:
            return self._skip(bad.what)
        self.guard.trained()
        seconds = time.perf_counter() - start
        metrics = {
            "train/outcome_reward": experience.outcome_rewards.mean(),
            "train/accuracy": experience.correct.float().mean(),
            "train/response_length": experience.response_lengths.float().mean(),
            "train/tokens_per_s": float(experience.response_mask.sum()) / seconds,
            "train/skipped_steps": float(self.guard.skipped_steps),
            **self._throughput(float(experience.attention_mask.sum()), seconds),
            **rollout_metrics(self.rollout_engine, experience, self.rollout.max_staleness),
            **stats,
        }
        if experience.entropy is not None:  # else the update measured it (``stats``)
            metrics["train/entropy"] = experience.entropy.mean()
        if self.reward_model is not None:  # the model's own scalars came with the step's stats
            metrics.update(_token_reward_statistics(experience))
        rows = experience.batch_size
        self.log_dict({k: float(v) for k, v in metrics.items()}, batch_size=rows)
        self.log("reward", experience.outcome_rewards.mean(), prog_bar=True, logger=False, batch_size=rows)
        self.log("acc", experience.correct.float().mean(), prog_bar=True, logger=False, batch_size=rows)
        return {"rollouts": experience}  # on_train_batch_end's outputs, for callbacks (flowkit.modules.CompletionLogs)

    def _skip(self, bad: list[str]) -> None:
        """A non-finite step (:class:`~flowkit.modules.step_guard.StepGuard` decides: fail or skip): its gradients so
        far are dropped, the skip counted in ``train/skipped_steps``."""
        if self.reward_model is not None:  # name the method that produced them
            bad = [f"{what} (from {type(self.reward_model).__name__}.score)" if what == "token rewards" else what
                   for what in bad]
        self.optimizers().zero_grad()  # the skipped step's scorer, and what it accumulated, went with the step
        self.guard.skip(self.trainer, bad, self.global_step + 1)  # counted from 1 as in metrics.csv and the bar
        self.log("train/skipped_steps", float(self.guard.skipped_steps))

    def _check_finite_weights(self, when: str) -> None:
        """Stop the run when any rank's weights hold a non-finite value (a collective)."""
        optimizers = self.trainer.optimizers  # none when a checkpoint is saved outside fit
        param_groups = optimizers[0].param_groups if optimizers else self.configure_optimizers().param_groups
        self.guard.check_weights(self.trainer, param_groups, f"the {{}} are non-finite {when}")

    def _throughput(self, tokens: float, seconds: float) -> dict[str, float]:
        """verl's ``perf/throughput``: this rank's prompt + response tokens per second of the step; ``perf/mfu``:
        :func:`~flowkit.step.throughput.model_flops_utilization` of one forward and backward over them against
        ``peak_flops`` (the whole step's time, generation included, so below verl's update-only actor MFU)."""
        metrics = {"perf/throughput": tokens / seconds}
        peak = self.hparams.peak_flops or device_peak_flops(self.device)
        if peak is not None:
            parameters = sum(getattr(p, "ds_numel", p.numel()) for p in self.policy.parameters())  # ZeRO-3: whole
            metrics["perf/mfu"] = model_flops_utilization(parameters, tokens, seconds, peak)
        return metrics

    @torch.no_grad()
    def score_rollouts(self, batch: RolloutBatch) -> RolloutBatch:
        """No-grad forward in micro-batches: old log-probs, mean entropies and (if the reward model wants them)
        the latents of every row (for ``flowkit score``; training keeps latents one micro-batch at a time)."""
        length = batch.input_ids.shape[1]
        parts = [self.actor.forward(batch.select(rows).trimmed(), tap=True)
                 for rows in torch.arange(batch.batch_size).split(self.update.micro_batch_size or batch.batch_size)]
        batch.old_logprobs = torch.cat([pad_columns(p.logprobs, length) for p in parts])
        entropy = torch.cat([pad_columns(p.entropy, length) for p in parts])
        batch.entropy = (entropy * batch.response_mask).sum(-1) / batch.response_mask.sum(-1).clamp(min=1)
        if self.tap is not None:
            batch.latents = torch.cat([pad_columns(p.latents, length, dim=2) for p in parts], dim=1)
        return batch

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The engine learns of the weights the step produced (policy version = optimizer steps so far): an engine
        with its own copy (vLLM) pushes them before its next generation."""
        self.rollout_engine.sync_weights(self.policy, self.global_step)

    # ----------------------------------------------------------------------------------------- optimizer, checkpoints
    def configure_optimizers(self) -> torch.optim.Optimizer:
        """:func:`~flowkit.modules.policy_optimizers.build_optimizer`; a fresh fit first runs the offline flow
        pretraining (:func:`~flowkit.modules.policy_optimizers.pretrain_unless_resuming`)."""
        pretrain_unless_resuming(self._trainer, self.pretrain_reward_model, self.flow_pretrain.steps)
        return build_optimizer(self.policy, self.value_head, self.reward_model, self.optim.lr, self.optim.flow_lr)

    def pretrain_reward_model(self, device: torch.device | None = None) -> None:
        """The offline start (:func:`~flowkit.modules.policy_optimizers.pretrain_reward_model`) on ``device``."""
        pretrain_reward_model(self.trainer, self.policy, self.tokenizer, self.tap, self.reward_model,
                              self.flow_pretrain, self.optim.flow_lr, device)

    def check_resume(self, checkpoint: dict[str, Any], path: str) -> None:
        """:func:`~flowkit.modules.policy_checkpoints.check_resume` of this config's model (the CLI calls it)."""
        check_resume(checkpoint, path, self.hparams.backbone, self.reward_model, self.state_dict(),
                     self.flow_pretrain.steps)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._check_finite_weights("when saving a checkpoint")  # never a checkpoint of non-finite weights
        checkpoint["skipped_steps"] = self.guard.skipped_steps  # a resumed run keeps counting
        checkpoint[REWARD_MODEL_KEY] = reward_model_settings(self.reward_model)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.guard.skipped_steps = int(checkpoint.get("skipped_steps", 0))

    # ----------------------------------------------------------------------------------------- validation, export
    def on_validation_epoch_start(self) -> None:
        self.validator.start(list(getattr(self.trainer.datamodule, "val_names", None) or ["heldout"]), self.device)

    def validation_step(self, prompts: dict[str, list[str]], batch_idx: int, dataloader_idx: int = 0) -> None:
        for key, value, size in self.validator.step(prompts, dataloader_idx, self.rollout_engine, self.reward_model):
            self.log(key, value, add_dataloader_idx=False, batch_size=size)

    def export_artifacts(self, directory: str | Path) -> dict[str, Path]:
        """Policy in HF format (full weights or the PEFT adapter) + tokenizer, and the flow in safetensors."""
        bad = [name for name, p in self.named_parameters() if p.numel() and not bool(torch.isfinite(p).all())]
        if bad:  # e.g. `flowkit export` of a checkpoint written before the finite-state guard
            raise NonFiniteTraining(f"refusing to export non-finite weights: {len(bad)} tensor(s) hold NaN or inf "
                                    f"(e.g. {bad[0]}); export an earlier checkpoint")
        directory = Path(directory)
        paths = {"policy": directory / "hf_policy"}
        self.policy.save_pretrained(paths["policy"], safe_serialization=True)
        self.tokenizer.save_pretrained(paths["policy"])
        if isinstance(self.reward_model, ExportsWeights):
            paths["flow"] = directory / "flow.safetensors"
            self.reward_model.save_field(paths["flow"])
        return paths


class DataModulePrompts:
    """Dynamic sampling's extra prompts (:class:`~flowkit.step.PromptSource`): the ``extra_batch`` of the trainer's
    datamodule (:class:`~flowkit.modules.RolloutDataModule`)."""

    def __init__(self, module: L.LightningModule):
        self.module = module

    def extra_batch(self, step: int, draw: int) -> PromptBatch | None:
        """None once any rank received SIGTERM (a collective: every rank draws as often), so the step ends with the
        groups it kept and the pre-emption checkpoint follows it."""
        if all_reduce_int(int(self.module.trainer.received_sigterm), torch.distributed.ReduceOp.MAX):
            return None
        datamodule = self.module.trainer.datamodule
        extra_batch = getattr(datamodule, "extra_batch", None)
        if extra_batch is None:
            raise ConfigError(f"{OWNER}.controls.dynamic_sampling_max_draws draws more prompts from the datamodule's "
                              f"extra_batch (RolloutDataModule), which {type(datamodule).__name__} lacks")
        return PromptBatch.of(extra_batch(step, draw))


def _token_reward_statistics(batch: Experience) -> dict[str, torch.Tensor]:
    """Mean, std, min, max and the nonzero fraction of the reward model's token rewards on response tokens."""
    if batch.token_rewards is None or not batch.response_mask.any():
        return {}
    values = batch.token_rewards[batch.response_mask.bool()].float()
    return {"train/token_reward/mean": values.mean(), "train/token_reward/std": values.std(unbiased=False),
            "train/token_reward/min": values.min(), "train/token_reward/max": values.max(),
            "train/token_reward/nonzero_frac": (values != 0).float().mean()}

