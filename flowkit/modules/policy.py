"""`PolicyModule`: GRPO / PPO with a pluggable dense reward model (RLFR Alg. 1 when the reward is a FlowReward)."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch.distributed import ReduceOp
from torchmetrics import MeanMetric

from flowkit.batch import RolloutBatch, pad_columns
from flowkit.checkpointing.resume import resume_checkpoint
from flowkit.distributed import all_reduce_int
from flowkit.engine import (
    Actor, AdvantageOptions, KLReference, LossOptions, NonFiniteStep, RLStep, SamplingControls, SamplingOptions,
    UpdateOptions,
)
from flowkit.engine.step import GROUP_NAMES, nonfinite_groups, raise_if_nonfinite
from flowkit.engine.throughput import device_peak_flops, model_flops_utilization
from flowkit.errors import ConfigError, NonFiniteTraining, check_range
from flowkit.llm.backbone import load_backbone
from flowkit.llm.engines import ROLLOUT_ENGINES, EngineSetup, RolloutEngine
from flowkit.llm.latent_tap import LatentTap
from flowkit.llm.lora import LoraSettings, apply_lora
from flowkit.modules.optim import LR_DECAYS, LrDecay, require_fp32_master_weights, step_groups
from flowkit.modules.pretraining import pretrain_flow_reward
from flowkit.modules.sft import supervised_start
from flowkit.rewards.base import (
    EvaluatesPolicy, ExportsWeights, PretrainsOnLatents, TokenRewardModel, check_reward_model,
)
from flowkit.rewards.functions import build_reward_functions, outcome_rewards
from flowkit.rewards.grader import grade
from flowkit.rl.advantages import ESTIMATORS, AdvantageName, ScaleRewards
from flowkit.rl.logprobs import DEFAULT_LM_HEAD_CHUNK
from flowkit.rl.losses import Aggregation, KLEstimator, PolicyLossName
from flowkit.rl.metrics import pass_at_k
from flowkit.rl.rollout_correction import RolloutCorrection
from flowkit.strategies import accumulate_until_step, average_gradients, manual_backward, whole_weights_for_generation

log = logging.getLogger(__name__)

REWARD_MODEL_KEY = "reward_model_settings"  # in a checkpoint: PolicyModule._reward_model_settings()
# Reward-model settings that a checkpoint's reward state is only valid for (shapes, which layers are tapped, the field's
# conditioning); the others (eta, beta, kappa, timesteps, ...) apply on resume as the config gives them.
RESUME_FIXED_REWARD_SETTINGS = ("percentiles", "depth", "width", "condition")


class PolicyModule(L.LightningModule):
    """Train a causal LM with GRPO (or PPO) on verifier rewards, shaped by a dense :class:`TokenRewardModel`.

    One RL step (one prompt batch of this rank, :class:`flowkit.engine.RLStep`): sample ``num_samples`` responses
    per prompt → grade them → advantages (``grpo``: RLFR eq. 9; ``gae``; ``reinforce``) from the outcome and the
    reward model's token rewards → ``ppo_epochs × num_minibatches`` clipped-surrogate updates. The reward model's
    online loss (e.g. the flow update on rejection-sampled rollouts) joins the first update; policy, reward model and
    value head are parameter groups of one optimizer. This module builds the engine and owns the Lightning hooks,
    logging, validation, export and the offline start.

    Memory is set by ``micro_batch_size``, not by the batch: every pass over the rollouts runs in micro-batches
    of that many sequences, log-probs come from the LM head in chunks of response tokens (never B×S×V logits),
    the flow rewards of a micro-batch are computed right after its forward, and only the latents of rollouts
    the online flow update may use are kept (on CPU). Gradients accumulate over a minibatch's micro-batches and
    the loss is normalised over the whole minibatch, so results do not depend on ``micro_batch_size``.
    With ``ppo_epochs × num_minibatches = 1`` (on-policy, the default) there is no separate scoring pass: the
    old log-probs are the detached log-probs of the training forward, whose tap also yields the latents.

    Args:
        backbone: hub id, local dir, or ``bundled:tiny_adder``.
        dtype: parameter dtype of the backbone: ``bfloat16`` for real models under DeepSpeed (fp32 master copies);
            elsewhere ``float32`` with ``precision: bf16-mixed`` (bf16 weights there are a ConfigError).
        trust_remote_code: passed to ``from_pretrained``; off unless you trust the model repo.
        lora: LoRA settings (peft); ``None`` fine-tunes all weights.
        reward_model: dense reward (e.g. :class:`~flowkit.rewards.FlowReward`); ``None`` is plain GRPO.
        num_samples: responses per prompt (GRPO group size).
        max_new_tokens, temperature, top_p: sampling; temperature 0 (greedy) needs ``num_samples`` 1.
        outcome_reward: the math grader's reward: ``official`` (1 correct, 0.5 wrong but boxed, 0 otherwise),
            ``binary`` (1 correct, else 0) or ``none`` (only ``reward_functions``; accuracy is still graded).
        reward_functions: TRL-style reward functions ``f(prompts, completions, **columns) -> list[float]`` added to
            the grader's reward with weights, ``[{function: dotted.path | class_path: ..., init_args: {...},
            weight: w}]`` (:mod:`flowkit.rewards.functions`); each one's mean is logged as ``train/reward/<name>``.
        advantage: the estimator (:mod:`flowkit.rl.advantages`): ``grpo`` (group-normalised outcome + reward-to-go of
            the token rewards, RLFR eq. 9), ``gae`` (a value head on the policy's last hidden state, GAE(γ, λ) over the
            token rewards with the outcome on the last token, whitened; PPO as TRL's PPO trainer) or ``reinforce``
            (the whitened reward-to-go, no value head).
        gamma: discount of the dense rewards' reward-to-go; lam: GAE's λ (``gae``).
        vf_coef, value_clip: weight and clip of the value loss (``gae``; TRL defaults 0.1, 0.2).
        outcome_placement: where the outcome advantage Â_o enters eq. 9: ``every_token`` (the paper: added to
            every token, undiscounted) or ``last_token`` (the official code: a reward on the last response token,
            discounted with γ like the token rewards). The two agree at γ = 1.
        clip_low, clip_high: ε and ε_high of the clipped surrogate.
        aggregation: loss aggregation over a minibatch: ``token-mean`` (Σ tokens / number of response tokens,
            DAPO), ``seq-mean`` (mean of per-sequence means, GRPO) or ``dr-grpo`` (Σ tokens /
            (B·max_new_tokens), Dr. GRPO).
        scale_rewards: std used to scale the outcome advantage (TRL's option): ``group`` (GRPO), ``batch`` or
            ``none`` (Dr. GRPO).
        clip_ratio_c: dual-clip bound c > 1 for negative advantages (verl's ``clip_ratio_c``, usually 3); None off.
        ppo_epochs: μ, passes over each generation; num_minibatches: updates per pass. Each update is an optimizer
            step, and Lightning's ``trainer.max_steps`` counts optimizer steps: ppo_epochs × num_minibatches per RL
            step (the logged ``step`` counts RL steps).
        kl_coef: weight of the KL to the initial policy (0 = off, the paper's setting). The reference is the base
            model read with the LoRA adapters disabled under ``lora`` (no second copy), else a frozen copy.
        kl_estimator: ``k1``, ``k2``, ``k3`` (= verl's ``low_var_kl``, the default) or ``low_var_kl``
            (:func:`~flowkit.rl.losses.kl_estimate`); kl_in: ``loss`` (a loss term, as GRPO / verl) or ``reward``
            (subtracted from the token rewards before the advantages, as TRL's PPO).
        lr, flow_lr: learning rates of the policy and reward-model parameter groups.
        max_grad_norm: gradient clipping over both groups (``None`` = off); under DeepSpeed it becomes the
            config's ``gradient_clipping`` (Lightning leaves clipping to DeepSpeed there).
        flow_pretrain_steps: offline start — steps of reward-model pretraining on the DataModule's expert
            solutions with the backbone frozen, run once before RL (skipped when resuming); AdamW at ``flow_lr``
            after a 10 % warmup (:func:`~flowkit.modules.optim.flow_pretraining_schedule`).
        flow_pretrain_batch_size: expert solutions per pretraining step.
        flow_pretrain_cache_latents: encode each expert solution once and keep its latents on CPU for the later
            epochs of pretraining (the backbone is frozen, so they do not change); for small backbones and datasets.
        flow_pretrain_lr_decay: ``cosine`` to 0 after the warmup (the official offline pretraining) or ``constant``
            (the tiny default: its short pretraining leaves the flow undertrained, and decay cost it error signal).
        val_num_samples, val_temperature: samples per prompt in validation (pass@1 and pass@k, k = n);
            temperature 0 is greedy with one sample.
        nonfinite: what to do when logits, rewards or advantages are not finite: ``skip`` the step
            (logged as ``train/skipped_steps``) or ``fail``.
        grader_timeout: seconds allowed to grade one response.
        micro_batch_size: sequences per forward/backward in every pass over the rollouts (scoring, flow rewards,
            policy update, online flow loss); None = a whole minibatch at once (fastest on the tiny job).
        rollout_batch_size: sequences per HF decoding batch (a multiple of ``num_samples``; bounds the KV
            cache); None = the whole batch in one call.
        lm_head_chunk_size: response tokens per LM-head call when computing log-probs and entropies (bounds the
            vocabulary-sized logits to chunk × V); None = all of a micro-batch's response tokens at once.
        gradient_checkpointing: recompute the decoder's activations in the backward (HF gradient
            checkpointing), for long rollouts of large models.
        rollout_correction: the correction of rows the rollout engine sampled from another distribution than the
            trainer's forward (its numerics, or older weights): truncated / masked importance weights per token or
            sequence, IcePop, the off-policy sequence mask, or PPO anchored at the rollout's log-probs
            (:class:`~flowkit.rl.rollout_correction.RolloutCorrection`; TRL / verl). The mismatch is logged as
            ``rollout_corr/...`` whatever it is set to. None: no correction.
        max_consecutive_skips: with ``nonfinite: skip``, fail (with the reason) after this many RL steps in a
            row were skipped, e.g. NaN weights that no step can repair; None never fails.
        rollout_engine: a name of :data:`flowkit.llm.engines.ROLLOUT_ENGINES`: ``hf`` (flowkit's decoding loop over
            the policy itself, :class:`~flowkit.llm.hf_engine.HFRolloutEngine`) or ``vllm``: a vLLM engine colocated in
            this process, one per rank (``pip install flowkit[vllm]``), into which the policy's weights are synced
            after every training step (LoRA merged, ZeRO-3 gathered). Both return their sampler's log-probs for
            ``rollout_correction``. ``rollout_batch_size`` applies to ``hf`` only (vLLM schedules its own batches).
            ``server``: generation in a ``flowkit rollout-server`` process on its own devices (``rollout_server_*``
            below; its decoding batches are ``rollout_batch_size``).
        vllm_gpu_memory_utilization: share of the GPU vLLM may take for its weights and KV cache (CPU: the KV cache
            is ``VLLM_CPU_KVCACHE_SPACE`` GiB instead).
        vllm_max_model_len: longest prompt + response vLLM sizes its KV cache for; None = the model's maximum.
        vllm_enable_sleep_mode: on GPU, vLLM releases its memory while the trainer trains (weights offloaded to
            CPU, KV cache freed) and takes it back to generate; vLLM's CPU backend has no sleep mode.
        rollout_server_url: the ``server`` engine's address, where ``flowkit rollout-server`` listens (e.g.
            ``http://10.0.0.5:8000``; :mod:`flowkit.llm.server_engine`): generation runs there, on its own devices,
            and the weights are pushed to it over torch.distributed (gloo on CPU, NCCL on GPU).
        rollout_server_timeout: seconds any wait on the server may take (a request, a weight push, prefetched
            rollouts); past it, or when the server is down, restarted or serves another model, the run stops with
            one line naming the address.
        rollout_server_sync_every: push the weights to the server every this many optimizer steps (1: each);
            rollouts in between come from weights up to that many versions old.
        rollout_server_bucket_mb: a weight push moves the weights in buckets of this size (ZeRO-3: gathered one
            weight at a time), which bounds its memory.
        max_staleness: k ≥ 1 overlaps generation with training (an engine that generates elsewhere: ``server``):
            while step t trains, the server generates step t+1's rollouts from the weights it holds (version t,
            one behind the weights that will train on them); rollouts more than k versions behind are regenerated
            (``rollout/regenerated_rows``), the staleness is logged (``rollout/staleness_mean|max``). The flow
            reward and its online update read the latents of the trainer's own forward, so nothing of the flow goes
            stale; only the sampling distribution does (``rollout_correction`` weighs it). 0: generate each step's
            rollouts when it starts, from its own weights (the synchronous run).
        entropy_advantage_alpha, entropy_advantage_kappa: "Entropy Adv." (Cheng et al. 2025, the logit-space baseline
            of RLFR Table 2): α > 0 adds min(α·H_t, |A_t|/κ) to every token's advantage, H_t the policy's token
            entropy (detached); it never flips A_t's sign (κ > 1) and adds nothing where A_t = 0. 0 is off; Cheng et
            al. run α 0.4, κ 2.
        sft_epochs, sft_lr: an SFT start before the first RL step (:func:`~flowkit.modules.sft.supervised_start`): the
            training records' ``solution`` completions, lr decaying linearly from ``sft_lr`` to 0 (the TPL paper: 3
            epochs on the preferred explanations, 2e-5, App. F); with a KL, PPO's reference is then the SFT'd policy.
        skip_zero_advantage_rows: the clipped loss of a token is proportional to its advantage, so a row whose
            advantages are all 0 (a group whose samples all earned the same reward, and no dense token reward)
            adds exactly nothing to the loss or its gradient; skip its forward/backward (with a KL term, or a reward
            model that needs the row's forward, every row runs). The loss normalisation still counts its tokens,
            so the update is unchanged; ``train/entropy`` then averages the rows that ran.
        policy_loss: ``ppo`` (the clipped surrogate), ``gspo`` (its ratio replaced by the row's length-normalised
            sequence ratio, GSPO-token; TRL ``importance_sampling_level="sequence"``, verl ``loss_mode: gspo``) or
            ``cispo`` (the clipped importance weight, detached, times ∇logπ: MiniMax-M1; verl ``loss_mode: cispo``)
            (:data:`flowkit.rl.losses.POLICY_LOSSES`); each with ``clip_low`` / ``clip_high``.
        entropy_coef: weight of an entropy bonus, −coef × the token entropy aggregated as the policy loss (verl's
            ``entropy_coeff``); 0 is off. With it, every row runs (a zero-advantage row still has an entropy).
        micro_batch_tokens: pack every pass's rows into micro-batches of at most this many tokens, padding
            included (rows × longest row; verl ``use_dynamic_bsz`` + ``ppo_max_token_len_per_gpu``): the step's rows
            are put longest first and cut into runs (with ``micro_batch_size`` also set, at most that many rows
            each); ranks agree on the count. Gradients are those of the whole minibatch; a reward model's noise is
            keyed by the rows' new positions. None: ``micro_batch_size`` rows per micro-batch.
        dynamic_sampling: DAPO's dynamic sampling, ``{max_draws: N}``: groups whose raw outcomes are all equal are
            dropped and more prompts generated until the batch is full, at most N generations per step
            (:class:`~flowkit.engine.options.SamplingControls`; the extra prompts: ``RolloutDataModule.extra_batch``).
            None is off. Logged: ``train/groups_kept``, ``train/groups_drawn``, ``train/sampling_draws``.
        mask_truncated: completions without EOS take no part in the policy loss (TRL ``mask_truncated_completions``).
        overlong_buffer: DAPO's soft overlong punishment ``{length: L_c, penalty: p}`` on the outcome reward
            (verl ``overlong_buffer``). With any of the three on, ``train/truncated_frac`` and
            ``train/zero_advantage_group_frac`` are logged.
        peak_flops: the device's peak FLOP/s for ``perf/mfu`` (6·N·tokens / step time / peak); None: the dense bf16
            peak of the CUDA device from :data:`flowkit.engine.throughput.DEVICE_PEAK_FLOPS` (vendor datasheets),
            and no ``perf/mfu`` on a CPU or an unknown GPU.
    """

    def __init__(
        self,
        backbone: str = "bundled:tiny_adder",
        dtype: str = "float32",
        trust_remote_code: bool = False,
        lora: LoraSettings | None = None,
        reward_model: TokenRewardModel | None = None,
        num_samples: int = 8,
        max_new_tokens: int = 1024,
        temperature: float = 1.0,
        top_p: float = 1.0,
        outcome_reward: Literal["official", "binary", "none"] = "official",
        reward_functions: list[dict[str, Any]] | None = None,
        advantage: AdvantageName = "grpo",
        gamma: float = 1.0,
        lam: float = 0.95,
        outcome_placement: Literal["every_token", "last_token"] = "every_token",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        aggregation: Aggregation = "token-mean",
        ppo_epochs: int = 1,
        num_minibatches: int = 1,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        kl_in: Literal["loss", "reward"] = "loss",
        vf_coef: float = 0.1,
        value_clip: float = 0.2,
        lr: float = 1e-6,
        flow_lr: float = 1e-4,
        max_grad_norm: float | None = 1.0,
        flow_pretrain_steps: int = 0,
        flow_pretrain_batch_size: int = 128,
        flow_pretrain_cache_latents: bool = False,
        flow_pretrain_lr_decay: LrDecay = "cosine",
        val_num_samples: int = 4,
        val_temperature: float = 1.0,
        nonfinite: Literal["skip", "fail"] = "skip",
        grader_timeout: float = 1.0,
        scale_rewards: ScaleRewards = "group",
        clip_ratio_c: float | None = None,
        micro_batch_size: int | None = None,
        rollout_batch_size: int | None = None,
        lm_head_chunk_size: int | None = DEFAULT_LM_HEAD_CHUNK,
        gradient_checkpointing: bool = False,
        rollout_correction: RolloutCorrection | None = None,
        max_consecutive_skips: int | None = 10,
        rollout_engine: str = "hf",
        vllm_gpu_memory_utilization: float = 0.3,
        vllm_max_model_len: int | None = None,
        vllm_enable_sleep_mode: bool = True,
        rollout_server_url: str | None = None,
        rollout_server_timeout: float = 300.0,
        rollout_server_sync_every: int = 1,
        rollout_server_bucket_mb: int = 256,
        max_staleness: int = 0,
        skip_zero_advantage_rows: bool = True,
        sft_epochs: int = 0,
        sft_lr: float = 2e-5,
        entropy_advantage_alpha: float = 0.0,
        entropy_advantage_kappa: float = 2.0,
        policy_loss: PolicyLossName = "ppo",
        entropy_coef: float = 0.0,
        micro_batch_tokens: int | None = None,
        peak_flops: float | None = None,
        dynamic_sampling: dict[str, int] | None = None,
        mask_truncated: bool = False,
        overlong_buffer: dict[str, float] | None = None,
    ):
        super().__init__()
        owner = "PolicyModule"
        self.sampling = SamplingOptions(num_samples, max_new_tokens, temperature, top_p)
        self.advantage = AdvantageOptions(advantage, gamma, lam, scale_rewards, outcome_placement,
                                          entropy_advantage_alpha, entropy_advantage_kappa)
        self.loss_options = LossOptions(clip_low, clip_high, clip_ratio_c, aggregation,
                                        rollout_correction or RolloutCorrection(), kl_coef,
                                        kl_estimator, kl_in, vf_coef, value_clip, max_new_tokens, policy_loss,
                                        entropy_coef)
        self.update = UpdateOptions(ppo_epochs, num_minibatches, micro_batch_size, lm_head_chunk_size, temperature,
                                    skip_zero_advantage_rows, micro_batch_tokens)
        self.controls = SamplingControls.from_groups(owner, dynamic_sampling, mask_truncated, overlong_buffer)
        self.controls.check(owner, max_new_tokens)
        check_range(owner, "peak_flops", peak_flops, 0, open_low=True)
        check_range(owner, "rollout_server_timeout", rollout_server_timeout, 0, open_low=True)
        check_range(owner, "rollout_server_sync_every", rollout_server_sync_every, 1)
        check_range(owner, "rollout_server_bucket_mb", rollout_server_bucket_mb, 1)
        check_range(owner, "max_staleness", max_staleness, 0)
        for group in (self.sampling, self.advantage, self.loss_options, self.update):
            group.check(owner)
        _check_module_options(owner, reward_model, outcome_reward, lr, flow_lr, max_grad_norm, flow_pretrain_steps,
                              flow_pretrain_batch_size, flow_pretrain_lr_decay, val_num_samples, val_temperature,
                              nonfinite, grader_timeout, rollout_batch_size, num_samples, max_consecutive_skips,
                              rollout_engine, sft_epochs, sft_lr)
        ROLLOUT_ENGINES[rollout_engine].check()  # before the backbone loads
        self.save_hyperparameters(ignore=["reward_model"])
        self.automatic_optimization = False
        self.reward_functions = build_reward_functions(reward_functions)
        if outcome_reward == "none" and not self.reward_functions and reward_model is None:
            raise ConfigError("PolicyModule.outcome_reward 'none' needs a reward_model or at least one entry in "
                              "reward_functions")
        self.policy, self.tokenizer = load_backbone(backbone, dtype, trust_remote_code)
        self.policy.train()  # from_pretrained returns eval mode; RL trains in train mode, as after flow pretraining
        self.reference = None  # the frozen initial policy of the KL, without LoRA (a checkpoint key)
        if kl_coef > 0 and lora is None:
            self.reference, _ = load_backbone(backbone, dtype, trust_remote_code)
        if lora is not None:
            self.policy = apply_lora(self.policy, lora)
        if gradient_checkpointing:
            # newer transformers name it activation_checkpointing_enable (the old name warns); older ones lack it
            getattr(self.policy, "activation_checkpointing_enable", self.policy.gradient_checkpointing_enable)(
                {"use_reentrant": False})
        self.value_head = (torch.nn.Linear(self.policy.config.hidden_size, 1) if ESTIMATORS[advantage].value_head
                           else None)
        self.reward_model = reward_model
        self.tap = None
        if reward_model is not None and reward_model.percentiles:
            self.tap = LatentTap(self.policy, reward_model.percentiles)
        if reward_model is not None:
            check_reward_model(reward_model)
            reward_model.bind(self.policy, self.tap.layer_positions if self.tap is not None else [], self.tokenizer)
        self.engine: RolloutEngine = ROLLOUT_ENGINES[rollout_engine].build(EngineSetup(
            self.policy, self.tokenizer, backbone, max_new_tokens, temperature, top_p, self.hparams,
            whole_weights=lambda: whole_weights_for_generation(self._trainer, self.policy)))
        if max_staleness and not hasattr(self.engine, "prefetch"):
            raise ConfigError(f"PolicyModule.max_staleness {max_staleness} needs a rollout engine that generates apart "
                              f"from training (rollout_engine: server), not {rollout_engine!r}")
        # after an SFT start, PPO's reference is the post-SFT policy: a snapshot (a frozen adapter under LoRA)
        reference = KLReference(self.policy, self.reference, snapshot_adapter=sft_epochs > 0) if kl_coef > 0 else None
        self.actor = Actor(self.policy, self.tap, self.value_head, reference, self.update, self.loss_options)
        self.rl_step = RLStep(self.actor, self.engine, reward_model, self.grade_rollouts, self.advantage, self.update,
                              num_samples, backward=lambda loss: manual_backward(self, loss),
                              step_optimizer=self.step_optimizer, controls=self.controls,
                              draw_prompts=self.draw_prompts)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.sft_losses: list[float] = []
        self.val_metrics = torch.nn.ModuleDict()
        self.val_set_names: list[str] = []

    # ----------------------------------------------------------------------------------------- training
    def setup(self, stage: str) -> None:
        hp = self.hparams
        if stage == "fit":
            require_fp32_master_weights("PolicyModule", self.trainer.strategy, self, hp.lr)
            accumulate_until_step(self.trainer, hp.max_grad_norm)

    def on_fit_start(self) -> None:
        """The SFT start (``sft_epochs``), once, before the first RL step; then the KL reference becomes the SFT'd
        policy (a resumed run restores both from its checkpoint)."""
        if self.hparams.sft_epochs and self.global_step == 0:
            self.sft_losses = supervised_start(self, self.hparams.sft_epochs, self.hparams.sft_lr)
            if self.actor.reference is not None:
                self.actor.reference.snapshot()

    def pretrain_reward_model(self, device: torch.device | None = None) -> None:
        """Offline start (RLFR §3.2): :func:`~flowkit.modules.pretraining.pretrain_flow_reward` with the policy frozen,
        ``flow_pretrain_steps`` steps at ``flow_lr``, on ``device`` (default: where the policy is)."""
        hp = self.hparams
        if not isinstance(self.reward_model, PretrainsOnLatents) or self.tap is None:
            raise ValueError("flow_pretrain_steps > 0 needs a reward model with latents and pretrain_losses (FlowReward)")
        pretrain_flow_reward(self.trainer, self.policy, self.tokenizer, self.tap, self.reward_model,
                             hp.flow_pretrain_steps, hp.flow_pretrain_batch_size, hp.flow_lr, hp.flow_pretrain_lr_decay,
                             hp.flow_pretrain_cache_latents, device)

    def _pretrain_unless_resuming(self) -> None:
        """The offline start, run where every strategy calls :meth:`configure_optimizers`: inside ``strategy.setup``,
        after DDP / single-device strategies placed the model on its device and before DeepSpeed copies the weights
        into its optimizer partitions (which a later pretraining would not reach). On the strategy's root device;
        skipped when the fit resumes a checkpoint, which holds the reward model's pretrained and trained weights."""
        if self.hparams.flow_pretrain_steps == 0 or self._trainer is None or resume_checkpoint(self.trainer) is not None:
            return
        self.pretrain_reward_model(self.trainer.strategy.root_device)

    def on_train_start(self) -> None:
        """Training starts, fresh or resumed: the config's learning rates apply (:meth:`_apply_configured_lr`);
        non-finite weights (a flow file or checkpoint holding NaN, a diverged pretraining), which would only skip
        every step, stop the run in one line; the engine learns of the weights training starts from (after an SFT
        start; resumed: restored by now, at version ``global_step``)."""
        self._apply_configured_lr()
        self._check_finite_weights("at the start of training")
        self.engine.sync_weights(self.policy, self.global_step)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """``max_staleness`` ≥ 1: the engine starts generating the next step's rollouts now, while this step trains
        (the next batch of a :class:`~flowkit.modules.datamodule.PromptStream`, a pure function of its index; the
        last step prefetches nothing). The engine's requests run in order, so a step with nothing prefetched asks for
        its own rollouts first. A resumed run prefetches from its first step on: no step's prompts are lost
        or generated twice for training."""
        stream = getattr(self.trainer.train_dataloader, "dataset", None)
        updates = self.update.ppo_epochs * self.update.num_minibatches  # optimizer steps of an RL step
        last = self.trainer.max_steps >= 0 and self.global_step + updates >= self.trainer.max_steps
        if self.hparams.max_staleness and hasattr(stream, "batch") and "index" in batch and not last:
            samples = self.sampling.num_samples
            if not self.engine.prefetched(batch["prompt"], samples):  # the first step (or resumed): its own first
                self.engine.prefetch(batch["prompt"], samples)
            self.engine.prefetch(stream.batch(int(batch["index"]) + 1)["prompt"], samples)

    def _staleness_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """How many policy versions behind the weights this step trains the rows were sampled from, and the rows
        regenerated so far for being more than ``max_staleness`` behind."""
        if batch.policy_versions is None:
            return {}
        staleness = (self.engine.policy_version - batch.policy_versions).float()
        metrics = {"rollout/staleness_mean": staleness.mean(), "rollout/staleness_max": staleness.max()}
        if hasattr(self.engine, "regenerated_rows"):
            metrics["rollout/regenerated_rows"] = float(self.engine.regenerated_rows)
        return metrics

    def training_step(self, prompts: dict[str, Any], batch_idx: int) -> None:
        start = time.perf_counter()
        try:
            columns = {key: value for key, value in prompts.items() if key not in ("prompt", "answer", "index")}
            batch, stats = self.rl_step(prompts["prompt"], prompts["answer"], int(prompts["index"]), columns)
        except NonFiniteStep as bad:
            return self._skip(bad.what)
        self.consecutive_skips = 0
        seconds = time.perf_counter() - start
        metrics = {
            "train/outcome_reward": batch.outcome_rewards.mean(),
            "train/accuracy": batch.correct.float().mean(),
            "train/entropy": batch.entropy.nanmean(),
            "train/response_length": batch.response_lengths.float().mean(),
            "train/tokens_per_s": float(batch.response_mask.sum()) / seconds,
            "train/skipped_steps": float(self.skipped_steps),
            **self._throughput(float(batch.attention_mask.sum()), seconds),
            **self._staleness_metrics(batch),
            **stats,
        }
        if self.reward_model is not None:  # the model's own scalars came with the step's stats
            metrics.update(_token_reward_statistics(batch))
        self.log_dict({k: float(v) for k, v in metrics.items()}, batch_size=batch.batch_size)
        self.log("reward", batch.outcome_rewards.mean(), prog_bar=True, logger=False, batch_size=batch.batch_size)
        self.log("acc", batch.correct.float().mean(), prog_bar=True, logger=False, batch_size=batch.batch_size)
        return {"rollouts": batch}  # on_train_batch_end's outputs, for callbacks (flowkit.modules.CompletionLogs)

    def draw_prompts(self, step: int, draw: int) -> tuple[list[str], list[str], dict[str, list]]:
        """Dynamic sampling's extra draw ``draw`` of RL step ``step``, from the datamodule's ``extra_batch``."""
        extra_batch = getattr(self.trainer.datamodule, "extra_batch", None)
        if extra_batch is None:
            raise ConfigError(f"PolicyModule.dynamic_sampling draws more prompts from the datamodule's extra_batch "
                              f"(RolloutDataModule), which {type(self.trainer.datamodule).__name__} lacks")
        prompts = extra_batch(step, draw)
        columns = {key: value for key, value in prompts.items() if key not in ("prompt", "answer", "index")}
        return prompts["prompt"], prompts["answer"], columns

    def _throughput(self, tokens: float, seconds: float) -> dict[str, float]:
        """verl's ``perf/throughput``: this rank's prompt + response tokens per second of the step; ``perf/mfu``:
        :func:`~flowkit.engine.throughput.model_flops_utilization` of one forward and backward over them against
        ``peak_flops`` (the whole step's time, generation included, so below verl's update-only actor MFU)."""
        metrics = {"perf/throughput": tokens / seconds}
        peak = self.hparams.peak_flops or device_peak_flops(self.device)
        if peak is not None:
            parameters = sum(getattr(p, "ds_numel", p.numel()) for p in self.policy.parameters())  # ZeRO-3: whole
            metrics["perf/mfu"] = model_flops_utilization(parameters, tokens, seconds, peak)
        return metrics

    def grade_rollouts(self, batch: RolloutBatch) -> RolloutBatch:
        """Outcome reward r_o (:func:`~flowkit.rewards.functions.outcome_rewards`); ``correct`` (the logged accuracy,
        the ``correct`` rejection metric) is the grader's verdict; each reward function's mean is logged."""
        rewards, correct, values = outcome_rewards(batch.responses, batch.answers, batch.prompts,
                                                   self.hparams.outcome_reward, self.reward_functions,
                                                   self.hparams.grader_timeout, batch.columns)
        if self._trainer is not None:
            for name, value in values.items():
                self.log(f"train/reward/{name}", value.nanmean(), batch_size=len(rewards))
        batch.outcome_rewards, batch.correct = rewards.to(self.device), correct.to(self.device)
        return batch

    def step_optimizer(self, groups: Collection[str]) -> None:
        """Clip (DeepSpeed clips inside its step: ``max_grad_norm`` is its ``gradient_clipping``), move only the
        parameter groups in ``groups`` (:func:`~flowkit.modules.optim.step_groups`), zero the gradients.

        Finite state: non-finite gradients of a group skip the step (:class:`NonFiniteStep`, on every rank) before
        the clipping, whose one norm over all groups would turn every group's gradients into NaN; weights that are
        not finite after the step stop the run (:meth:`_stop_nonfinite`) before anything is saved from them."""
        optimizer = self.optimizers()
        average_gradients(self)
        raise_if_nonfinite(nonfinite_groups(optimizer.param_groups, groups, "gradients"))
        if self.hparams.max_grad_norm is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")
        step = self.global_step + 1  # the step in progress, counted from 1 as in metrics.csv and the bar
        step_groups(optimizer, groups)
        optimizer.zero_grad()
        bad = nonfinite_groups(optimizer.param_groups, groups, "weights")
        if all_reduce_int(int(bool(bad)), ReduceOp.MAX):
            broken = ", ".join(bad) or "weights on another rank"
            self._stop_nonfinite(f"the optimizer step of RL step {step} made the {broken} non-finite (a learning rate "
                                 "too high?)")


    def _check_finite_weights(self, when: str) -> None:
        """Stop (:meth:`_stop_nonfinite`) when any rank's weights hold a non-finite value (a collective)."""
        optimizers = self.trainer.optimizers  # none when a checkpoint is saved outside fit
        param_groups = optimizers[0].param_groups if optimizers else self.configure_optimizers().param_groups
        bad = nonfinite_groups(param_groups, GROUP_NAMES, "weights")
        if all_reduce_int(int(bool(bad)), ReduceOp.MAX):
            self._stop_nonfinite(f"the {', '.join(bad) or 'weights on another rank'} are non-finite {when}")

    def _stop_nonfinite(self, problem: str) -> None:
        """Raise :class:`~flowkit.errors.NonFiniteTraining` naming the last good checkpoint (``--ckpt_path last``
        resumes it: no checkpoint is written from non-finite weights)."""
        callback = self.trainer.checkpoint_callback
        saved = [path for path in (getattr(callback, "last_model_path", ""), self.trainer.ckpt_path)
                 if path and Path(path).exists()]
        last_good = (f"the last good checkpoint is {saved[0]}: resume it with --ckpt_path {saved[0]} once the cause is "
                     "fixed" if saved else "no checkpoint was saved before it: start again once the cause is fixed")
        raise NonFiniteTraining(f"{problem}; nothing was saved from them, {last_good}")

    def _skip(self, bad: list[str]) -> None:
        """The ``nonfinite`` policy: fail, or drop the step (no optimizer step; gradients so far are discarded)."""
        if self.reward_model is not None:  # name the method that produced them
            bad = [f"{what} (from {type(self.reward_model).__name__}.score)" if what == "token rewards" else what
                   for what in bad]
        step = self.global_step + 1  # the step in progress, counted from 1 as in metrics.csv and the bar
        message = f"non-finite {', '.join(bad)} at step {step}"
        if self.hparams.nonfinite == "fail":
            raise NonFiniteTraining(message)
        self.optimizers().zero_grad()  # the skipped step's scorer, and what it accumulated, went with the step
        self.skipped_steps += 1
        self.consecutive_skips += 1
        limit = self.hparams.max_consecutive_skips
        if limit is not None and self.consecutive_skips >= limit:
            self._stop_nonfinite(f"{self.consecutive_skips} RL steps in a row were skipped (max_consecutive_skips "
                                 f"{limit}; the last one: {message}): the weights or the reward model are probably "
                                 "broken")
        log.warning("skipping RL step %d: non-finite %s (%d skipped so far)", step, ", ".join(bad), self.skipped_steps)
        self.log("train/skipped_steps", float(self.skipped_steps))
        return None

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
        self.engine.sync_weights(self.policy, self.global_step)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._check_finite_weights("when saving a checkpoint")  # never a checkpoint of non-finite weights
        checkpoint["skipped_steps"] = self.skipped_steps  # a resumed run keeps counting
        checkpoint[REWARD_MODEL_KEY] = self._reward_model_settings()

    def _reward_model_settings(self) -> dict[str, Any]:
        """What a checkpoint's reward-model state means: its class and the settings that shape or place it."""
        model = self.reward_model
        settings: dict[str, Any] = {"class": None if model is None else f"{type(model).__module__}.{type(model).__qualname__}"}
        for name in RESUME_FIXED_REWARD_SETTINGS:
            if hasattr(model, name):
                value = getattr(model, name)
                settings[name] = list(value) if isinstance(value, tuple) else value
        return settings

    def check_resume(self, checkpoint: dict[str, Any], path: str) -> None:
        """Before any work of a resume from ``checkpoint`` (read by the CLI from ``path``): refuse, in one
        :class:`~flowkit.errors.ConfigError` naming the setting and both values, a config whose model the checkpoint's
        state does not fit — another backbone, reward-model class (e.g. a GRPO checkpoint into an RLFR config), its
        percentiles, depth, width or condition, or any parameter's shape (LoRA, value head, KL reference). Every other
        setting applies on resume as the config gives it (the learning rates: :meth:`on_train_start`); a changed
        ``flow_pretrain_steps`` gets a note (the pretraining ran before the checkpoint)."""
        def refuse(setting: str, saved: Any, current: Any) -> None:
            raise ConfigError(f"cannot resume {path}: {setting} is {saved!r} there, {current!r} in this config; resume "
                              "with the settings it was trained with, or start a new run with "
                              "--trainer.default_root_dir runs/NEW_NAME")

        saved_hparams = checkpoint.get("hyper_parameters") or {}
        if "backbone" in saved_hparams and saved_hparams["backbone"] != self.hparams.backbone:
            refuse("backbone", saved_hparams["backbone"], self.hparams.backbone)
        state = checkpoint.get("state_dict")  # absent from a DeepSpeed checkpoint's client state
        recorded = checkpoint.get(REWARD_MODEL_KEY)
        if recorded is None and state is not None:  # checkpoints written before the settings were recorded
            recorded = {"class": "a reward model" if any(k.startswith("reward_model.") for k in state) else None}
        current = self._reward_model_settings()
        if recorded is not None:
            if (recorded["class"] is None) != (current["class"] is None) or (
                    recorded["class"] != "a reward model" and recorded["class"] != current["class"]):
                refuse("reward_model", recorded["class"] or "none", current["class"] or "none")
            for name in RESUME_FIXED_REWARD_SETTINGS:
                if name in recorded and recorded[name] != current.get(name):
                    refuse(f"reward_model.{name}", recorded[name], current.get(name))
        if state is not None:
            own = self.state_dict()
            for name, tensor in own.items():
                if name not in state:
                    refuse(f"parameter {name}", "absent", list(tensor.shape) if hasattr(tensor, "shape") else "present")
                if hasattr(tensor, "shape") and hasattr(state[name], "shape") and state[name].shape != tensor.shape:
                    refuse(f"the shape of {name}", list(state[name].shape), list(tensor.shape))
            extra = next((name for name in state if name not in own), None)
            if extra is not None:
                refuse(f"parameter {extra}", "present", "absent")
        pretrained = saved_hparams.get("flow_pretrain_steps")
        if pretrained is not None and pretrained != self.hparams.flow_pretrain_steps:
            log.warning("flow_pretrain_steps %d (was %d) does not apply on resume: the checkpoint holds the flow its "
                        "pretraining and training made", self.hparams.flow_pretrain_steps, pretrained)

    def _apply_configured_lr(self) -> None:
        """The config's learning rates apply on resume too (the optimizer's restored state carries the checkpoint's)."""
        configured = {"policy": self.hparams.lr, "value": self.hparams.lr, "reward": self.hparams.flow_lr}
        for group in self.optimizers().optimizer.param_groups:
            lr = configured.get(group.get("name"))
            if lr is not None and group["lr"] != lr:
                log.warning("resume: the %s group's learning rate %g → %g (this config's)", group["name"], group["lr"], lr)
                group["lr"] = lr

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.skipped_steps = int(checkpoint.get("skipped_steps", 0))

    def configure_optimizers(self):
        """One AdamW over the parameter groups ``policy`` (lr), ``value`` (the value head, lr) and ``reward`` (the
        reward model, flow_lr): DeepSpeed takes one optimizer. A fresh fit first runs the offline flow pretraining
        (:meth:`_pretrain_unless_resuming`)."""
        self._pretrain_unless_resuming()
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad], "lr": self.hparams.lr, "name": "policy"}]
        if self.value_head is not None:
            groups.append({"params": list(self.value_head.parameters()), "lr": self.hparams.lr, "name": "value"})
        if self.reward_model is not None and any(True for _ in self.reward_model.parameters()):
            groups.append({"params": list(self.reward_model.parameters()), "lr": self.hparams.flow_lr, "name": "reward"})
        return torch.optim.AdamW(groups, weight_decay=0.0)

    # ----------------------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self) -> None:
        """The metrics of each eval set, by position: a ``ModuleDict`` key cannot hold every name a user may give an
        eval set (``gsm8k.test``), so the names are kept beside it (:attr:`val_set_names`)."""
        names = list(getattr(self.trainer.datamodule, "val_names", None) or ["heldout"])
        if names != self.val_set_names:
            k = self._val_k()
            self.val_set_names = names
            self.val_metrics = torch.nn.ModuleDict({
                str(index): torch.nn.ModuleDict({"pass@1": MeanMetric(), f"pass@{k}": MeanMetric()})
                for index in range(len(names))}).to(self.device)

    def _val_k(self) -> int:
        return 1 if self.hparams.val_temperature == 0 else self.hparams.val_num_samples

    def validation_step(self, prompts: dict[str, list[str]], batch_idx: int, dataloader_idx: int = 0) -> None:
        """pass@1 and pass@k of the math grader on each eval set; a reward model with its own ``evaluate`` (e.g. the
        explanation reward's judged accuracy) reports that instead."""
        name = self.val_set_names[dataloader_idx]
        if isinstance(self.reward_model, EvaluatesPolicy):
            generate = lambda texts, n, temperature: self.engine.generate(texts, n, None, temperature=temperature)  # noqa: E731
            for key, (value, weight) in self.reward_model.evaluate(prompts, generate).items():
                if weight:
                    self.log(f"val/{name}/{key}", value, add_dataloader_idx=False, batch_size=int(weight))
            return
        k = self._val_k()
        batch = self.engine.generate(prompts["prompt"], k, prompts["answer"], temperature=self.hparams.val_temperature)
        correct = torch.tensor([grade(r, a, self.hparams.grader_timeout) for r, a in zip(batch.responses, batch.answers)])
        per_prompt = correct.view(-1, k).sum(-1)
        metrics = self.val_metrics[str(dataloader_idx)]
        metrics["pass@1"].update(pass_at_k(k, per_prompt, 1))
        metrics[f"pass@{k}"].update(pass_at_k(k, per_prompt, k))
        for key, metric in metrics.items():
            self.log(f"val/{name}/{key}", metric, add_dataloader_idx=False, batch_size=len(prompts["prompt"]))

    # ----------------------------------------------------------------------------------------- artifacts
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


def _token_reward_statistics(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """Mean, std, min, max and the nonzero fraction of the reward model's token rewards on response tokens."""
    if batch.token_rewards is None or not batch.response_mask.any():
        return {}
    values = batch.token_rewards[batch.response_mask.bool()].float()
    return {"train/token_reward/mean": values.mean(), "train/token_reward/std": values.std(unbiased=False),
            "train/token_reward/min": values.min(), "train/token_reward/max": values.max(),
            "train/token_reward/nonzero_frac": (values != 0).float().mean()}


def _check_module_options(owner: str, reward_model: TokenRewardModel | None, outcome_reward: str, lr: float,
                          flow_lr: float, max_grad_norm: float | None, flow_pretrain_steps: int,
                          flow_pretrain_batch_size: int, flow_pretrain_lr_decay: str, val_num_samples: int,
                          val_temperature: float, nonfinite: str, grader_timeout: float,
                          rollout_batch_size: int | None, num_samples: int, max_consecutive_skips: int | None,
                          rollout_engine: str, sft_epochs: int, sft_lr: float) -> None:
    """ConfigError for the options outside the engine's groups, before the backbone loads."""
    for name, value in [("flow_pretrain_batch_size", flow_pretrain_batch_size), ("val_num_samples", val_num_samples),
                        ("max_consecutive_skips", max_consecutive_skips)]:
        check_range(owner, name, value, 1)
    for name, value in [("val_temperature", val_temperature), ("flow_pretrain_steps", flow_pretrain_steps),
                        ("sft_epochs", sft_epochs)]:
        check_range(owner, name, value, 0)
    for name, value in [("lr", lr), ("flow_lr", flow_lr), ("max_grad_norm", max_grad_norm),
                        ("grader_timeout", grader_timeout), ("sft_lr", sft_lr)]:
        check_range(owner, name, value, 0, open_low=True)
    for name, value, allowed in [("outcome_reward", outcome_reward, ("official", "binary", "none")),
                                 ("nonfinite", nonfinite, ("skip", "fail")), ("rollout_engine", rollout_engine, tuple(ROLLOUT_ENGINES)),
                                 ("flow_pretrain_lr_decay", flow_pretrain_lr_decay, LR_DECAYS)]:
        if value not in allowed:
            raise ConfigError(f"{owner}.{name} must be one of {', '.join(allowed)}, got {value!r}")
    if rollout_batch_size is not None and (rollout_batch_size < 1 or rollout_batch_size % num_samples):
        raise ConfigError(f"{owner}.rollout_batch_size must be a positive multiple of num_samples ({num_samples}) "
                          f"(or null), got {rollout_batch_size}")
    if flow_pretrain_steps > 0 and not (isinstance(reward_model, PretrainsOnLatents) and reward_model.percentiles):
        missing = "percentiles" if isinstance(reward_model, PretrainsOnLatents) else "pretrain_losses"
        raise ConfigError(f"{owner}.flow_pretrain_steps {flow_pretrain_steps} needs a reward_model with latents to "
                          f"pretrain (flowkit.rewards.PretrainsOnLatents, e.g. a FlowReward); "
                          f"{type(reward_model).__name__ if reward_model else None} has no {missing}; "
                          "set flow_pretrain_steps 0")
