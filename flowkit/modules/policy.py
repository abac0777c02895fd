"""`PolicyModule`: GRPO with a pluggable dense reward model (RLFR Alg. 1 when the reward is a FlowReward)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor
from torch.distributed import ReduceOp
from torchmetrics import MeanMetric

from flowkit.batch import RolloutBatch, pad_columns
from flowkit.checkpointing import AtomicCheckpointIO, PreemptionCheckpoint, PretrainingPreempted, sigterm_stops
from flowkit.distributed import all_reduce_int
from flowkit.errors import ConfigError, check_range
from flowkit.llm.backbone import load_backbone, resolve_backbone_path
from flowkit.llm.latent_tap import LatentTap
from flowkit.llm.lora import LoraSettings, apply_lora
from flowkit.llm.rollout import ExpertLatentCache, RolloutEngine, expert_latents, forward_hidden
from flowkit.llm.vllm_engine import VllmRolloutEngine, require_vllm
from flowkit.modules.optim import LR_DECAYS, LrDecay, flow_pretraining_schedule, step_groups
from flowkit.modules.progress import LoopProgress
from flowkit.rewards.base import TokenRewardModel
from flowkit.rewards.functions import build_reward_functions, weighted_rewards
from flowkit.rewards.grader import grade, outcome_reward
from flowkit.rl.advantages import (
    ScaleRewards, group_normalized_advantage, outcome_at_last_token_advantages, token_advantages,
)
from flowkit.rl.logprobs import DEFAULT_LM_HEAD_CHUNK, lm_head_logprobs
from flowkit.rl.losses import Aggregation, aggregation_denominator, clipped_policy_loss, kl_penalty
from flowkit.rl.metrics import pass_at_k
from flowkit.strategies import accumulate_until_step, manual_backward

log = logging.getLogger(__name__)


class PolicyModule(L.LightningModule):
    """Train a causal LM with GRPO on verifier rewards, shaped by a dense :class:`TokenRewardModel`.

    One RL step (one prompt batch of this rank): sample ``num_samples`` responses per prompt → grade them →
    advantages (eq. 9) from the outcome and the reward model's token rewards → ``ppo_epochs × num_minibatches``
    clipped-surrogate updates. The reward model's online loss (e.g. the flow update on rejection-sampled
    rollouts) joins the first update; policy and reward model are two parameter groups of one optimizer.

    Memory is set by ``micro_batch_size``, not by the batch: every pass over the rollouts runs in micro-batches
    of that many sequences, log-probs come from the LM head in chunks of response tokens (never B×S×V logits),
    the flow rewards of a micro-batch are computed right after its forward, and only the latents of rollouts
    the online flow update may use are kept (on CPU). Gradients accumulate over a minibatch's micro-batches and
    the loss is normalised over the whole minibatch, so results do not depend on ``micro_batch_size``.
    With ``ppo_epochs × num_minibatches = 1`` (on-policy, the default) there is no separate scoring pass: the
    old log-probs are the detached log-probs of the training forward, whose tap also yields the latents.

    Args:
        backbone: hub id, local dir, or ``bundled:tiny_adder``.
        dtype: parameter dtype of the backbone (``bfloat16`` for real models).
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
        gamma: discount of the dense rewards' reward-to-go.
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
        ppo_epochs: μ, passes over each generation; num_minibatches: updates per pass.
        kl_coef: weight of the k3 KL to the frozen initial policy (0 = off, the paper's setting).
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
        rollout_batch_size: sequences per ``generate`` call (a multiple of ``num_samples``; bounds the KV
            cache); None = the whole batch in one call.
        lm_head_chunk_size: response tokens per LM-head call when computing log-probs and entropies (bounds the
            vocabulary-sized logits to chunk × V); None = all of a micro-batch's response tokens at once.
        gradient_checkpointing: recompute the decoder's activations in the backward (HF gradient
            checkpointing), for long rollouts of large models.
        rollout_is_cap: truncated importance-sampling correction for a rollout engine whose sampler differs from
            the trainer: the policy loss of each token is weighted by min(exp(logπ_old − logπ_rollout), cap)
            (verl / TRL); it applies when the engine returns its sampler's log-probs
            (``RolloutBatch.rollout_logprobs``, vLLM) and does nothing with HF ``generate``. None is off.
        max_consecutive_skips: with ``nonfinite: skip``, fail (with the reason) after this many RL steps in a
            row were skipped, e.g. NaN weights that no step can repair; None never fails.
        rollout_engine: ``hf`` (``generate`` of the policy itself) or ``vllm``: a vLLM engine colocated in this
            process, one per rank (``pip install flowkit[vllm]``), into which the policy's weights are synced after
            every training step (LoRA merged, ZeRO-3 gathered); it also returns its sampler's log-probs for
            ``rollout_is_cap``. ``rollout_batch_size`` applies to ``hf`` only (vLLM schedules its own batches).
        vllm_gpu_memory_utilization: share of the GPU vLLM may take for its weights and KV cache (CPU: the KV cache
            is ``VLLM_CPU_KVCACHE_SPACE`` GiB instead).
        vllm_max_model_len: longest prompt + response vLLM sizes its KV cache for; None = the model's maximum.
        vllm_enable_sleep_mode: on GPU, vLLM releases its memory while the trainer trains (weights offloaded to
            CPU, KV cache freed) and takes it back to generate; vLLM's CPU backend has no sleep mode.
        skip_zero_advantage_rows: the clipped loss of a token is proportional to its advantage, so a row whose
            advantages are all 0 (a group whose samples all earned the same reward, and no dense token reward)
            adds exactly nothing to the loss or its gradient; skip its forward/backward (with a KL term, or a reward
            model that needs the row's forward, every row runs). The loss normalisation still counts its tokens,
            so the update is unchanged; ``train/entropy`` then averages the rows that ran.
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
        gamma: float = 1.0,
        outcome_placement: Literal["every_token", "last_token"] = "every_token",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        aggregation: Aggregation = "token-mean",
        ppo_epochs: int = 1,
        num_minibatches: int = 1,
        kl_coef: float = 0.0,
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
        rollout_is_cap: float | None = None,
        max_consecutive_skips: int | None = 10,
        rollout_engine: Literal["hf", "vllm"] = "hf",
        vllm_gpu_memory_utilization: float = 0.3,
        vllm_max_model_len: int | None = None,
        vllm_enable_sleep_mode: bool = True,
        skip_zero_advantage_rows: bool = True,
    ):
        super().__init__()
        _check_options(reward_model, num_samples, max_new_tokens, temperature, top_p, outcome_reward, gamma, clip_low,
                       clip_high, ppo_epochs, num_minibatches, kl_coef, lr, flow_lr, max_grad_norm, flow_pretrain_steps,
                       flow_pretrain_batch_size, val_num_samples, val_temperature, nonfinite, grader_timeout)
        _check_step_options(aggregation, scale_rewards, clip_ratio_c, micro_batch_size, rollout_batch_size, num_samples,
                            lm_head_chunk_size, rollout_is_cap, max_consecutive_skips)
        if flow_pretrain_lr_decay not in LR_DECAYS:
            raise ConfigError(f"PolicyModule.flow_pretrain_lr_decay must be cosine or constant, got {flow_pretrain_lr_decay!r}")
        if rollout_engine not in ("hf", "vllm"):
            raise ConfigError(f"PolicyModule.rollout_engine must be hf or vllm, got {rollout_engine!r}")
        if rollout_engine == "vllm":
            require_vllm()  # before the backbone loads
        self.save_hyperparameters(ignore=["reward_model"])
        self.automatic_optimization = False
        self.reward_functions = build_reward_functions(reward_functions)
        if outcome_reward == "none" and not self.reward_functions:
            raise ConfigError("PolicyModule.outcome_reward 'none' needs at least one entry in reward_functions")
        self.policy, self.tokenizer = load_backbone(backbone, dtype, trust_remote_code)
        self.policy.train()  # from_pretrained returns eval mode; RL trains in train mode, as after flow pretraining
        self.reference = None
        if kl_coef > 0:
            self.reference, _ = load_backbone(backbone, dtype, trust_remote_code)
            self.reference.requires_grad_(False).eval()
        if lora is not None:
            self.policy = apply_lora(self.policy, lora)
        if gradient_checkpointing:
            # newer transformers name it activation_checkpointing_enable (the old name warns); older ones lack it
            getattr(self.policy, "activation_checkpointing_enable", self.policy.gradient_checkpointing_enable)(
                {"use_reentrant": False})
        self.reward_model = reward_model
        self.tap = None
        if reward_model is not None and reward_model.percentiles:
            self.tap = LatentTap(self.policy, reward_model.percentiles)
        if reward_model is not None:
            positions = self.tap.layer_positions if self.tap is not None else []
            reward_model.bind(self.policy.config.hidden_size, positions, getattr(self.policy.config, "rms_norm_eps", None))
        if rollout_engine == "vllm":
            self.engine = VllmRolloutEngine(self.policy, self.tokenizer, resolve_backbone_path(backbone), max_new_tokens,
                                            temperature, top_p, vllm_gpu_memory_utilization, vllm_max_model_len,
                                            vllm_enable_sleep_mode)
        else:
            self.engine = RolloutEngine(self.policy, self.tokenizer, max_new_tokens, temperature, top_p, rollout_batch_size)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.val_metrics = torch.nn.ModuleDict()

    # ----------------------------------------------------------------------------------------- forward passes
    def _micro_batches(self, rows: int, keep: Tensor | None = None) -> list[Tensor | None]:
        """Row indices of each micro-batch. With ``keep`` (a bool per row), only the kept rows, in as many
        micro-batches as the rank that keeps the most (at least one): every forward/backward is a collective under
        DDP and ZeRO, so a rank with fewer adds ``None`` entries, for :meth:`_padding_backward`."""
        index = torch.arange(rows) if keep is None else keep.cpu().nonzero().flatten()
        parts: list[Tensor | None] = list(index.split(self.hparams.micro_batch_size or rows)) if len(index) else []
        if keep is not None:
            parts += [None] * (all_reduce_int(max(1, len(parts)), ReduceOp.MAX) - len(parts))
        return parts

    def _rows_with_gradient(self, advantages: Tensor) -> Tensor | None:
        """Rows whose advantages (per row, or per token on response tokens) are not all 0, for
        ``skip_zero_advantage_rows``; None: every row runs."""
        if not self.hparams.skip_zero_advantage_rows or self.reference is not None:
            return None
        return advantages.reshape(len(advantages), -1).ne(0).any(-1)

    def _padding_backward(self, batch: RolloutBatch) -> None:
        """A zero loss through one row: this rank's share of a forward/backward that other ranks still run."""
        logprobs = self._forward(_rows(batch, torch.tensor([0])), tap=False)[0]
        manual_backward(self, logprobs.sum() * 0.0)

    def _forward(self, batch: RolloutBatch, tap: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """Log-probs (B×S, with gradient if enabled), per-token entropies (B×S) and, with ``tap``, the latents."""
        if tap and self.tap is not None:
            with self.tap:
                hidden = forward_hidden(self.policy, batch)
            latents = self.tap.latents
        else:
            hidden, latents = forward_hidden(self.policy, batch), None
        logprobs, entropy = lm_head_logprobs(hidden, self.policy.get_output_embeddings(), batch.input_ids,
                                             batch.response_mask, self.hparams.temperature or 1.0,
                                             self.hparams.lm_head_chunk_size)
        return logprobs, entropy, latents

    @torch.no_grad()
    def _reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        hidden = forward_hidden(self.reference, batch)
        return lm_head_logprobs(hidden, self.reference.get_output_embeddings(), batch.input_ids, batch.response_mask,
                                self.hparams.temperature or 1.0, self.hparams.lm_head_chunk_size)[0]

    @torch.no_grad()
    def score_rollouts(self, batch: RolloutBatch) -> RolloutBatch:
        """No-grad forward in micro-batches: old log-probs, mean entropies and (if the reward model wants them)
        the latents of every row (for ``flowkit score``; training keeps latents one micro-batch at a time)."""
        parts = [self._score_rows(_rows(batch, rows)) for rows in self._micro_batches(batch.batch_size)]
        length = batch.input_ids.shape[1]
        batch.old_logprobs = torch.cat([pad_columns(p.old_logprobs, length) for p in parts])
        batch.entropy = torch.cat([p.entropy for p in parts])
        if self.tap is not None:
            batch.latents = torch.cat([pad_columns(p.latents, length, dim=2) for p in parts], dim=1)
        if self.reference is not None:
            batch.ref_logprobs = torch.cat([pad_columns(p.ref_logprobs, length) for p in parts])
        return batch

    def _score_rows(self, micro: RolloutBatch) -> RolloutBatch:
        logprobs, entropy, micro.latents = self._forward(micro, tap=True)
        micro.old_logprobs = logprobs.detach()
        micro.entropy = _sequence_mean(entropy, micro.response_mask)
        if self.reference is not None:
            micro.ref_logprobs = self._reference_logprobs(micro)
        return micro

    def grade_rollouts(self, batch: RolloutBatch) -> RolloutBatch:
        """Outcome reward r_o: the math grader's reward (``outcome_reward``) + Σ weight_i · f_i over the reward
        functions. ``correct`` (the logged accuracy, the ``correct`` rejection metric) is the grader's verdict."""
        scheme, timeout = self.hparams.outcome_reward, self.hparams.grader_timeout
        pairs = list(zip(batch.responses, batch.answers))
        if scheme == "none":
            rewards = torch.zeros(len(pairs))
            correct = torch.tensor([grade(r, a, timeout) for r, a in pairs], dtype=torch.bool)
        else:
            rewards = torch.tensor([outcome_reward(r, a, scheme, timeout) for r, a in pairs], dtype=torch.float32)
            correct = rewards == 1.0  # both schemes give 1 exactly for a correct answer
        if self.reward_functions:
            total, values = weighted_rewards(self.reward_functions, batch.prompts, batch.responses, answer=batch.answers)
            rewards = rewards + total
            if self._trainer is not None:
                for name, value in values.items():
                    self.log(f"train/reward/{name}", value.nanmean(), batch_size=len(pairs))
        batch.outcome_rewards, batch.correct = rewards.to(self.device), correct.to(self.device)
        return batch

    # ----------------------------------------------------------------------------------------- training
    def setup(self, stage: str) -> None:
        if stage == "fit":
            accumulate_until_step(self.trainer, self.hparams.max_grad_norm)
        if stage == "fit" and self.hparams.flow_pretrain_steps > 0 and self.trainer.ckpt_path is None:
            self.pretrain_reward_model()

    def pretrain_reward_model(self) -> None:
        """Offline start (RLFR §3.2): fit the reward model to expert-solution latents, backbone frozen.

        Its state (reward-model weights, optimizer, schedule, noise generator, steps done) is saved to
        ``flow_pretrain.ckpt`` in the checkpoint directory when it finishes, and when SIGTERM stops it: then
        the process exits 0 (:class:`~flowkit.checkpointing.PretrainingPreempted`). A run of the job with no
        Lightning checkpoint to resume (``--ckpt_path last`` before the first one exists) continues from that
        file: it skips the batches already seen and trains only the remaining steps.
        """
        reward = self.reward_model
        if reward is None or not hasattr(reward, "pretrain_losses") or self.tap is None:
            raise ValueError("flow_pretrain_steps > 0 needs a reward model with latents and pretrain_losses (FlowReward)")
        steps = self.hparams.flow_pretrain_steps
        device = next(self.policy.parameters()).device
        reward.to(device)
        optimizer = torch.optim.AdamW(reward.parameters(), lr=self.hparams.flow_lr)
        schedule = flow_pretraining_schedule(optimizer, steps, decay=self.hparams.flow_pretrain_lr_decay)
        generator = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
        batches = self.trainer.datamodule.expert_batches(self.hparams.flow_pretrain_batch_size, seed=torch.initial_seed() % 2**31)
        state_path = PreemptionCheckpoint.pretraining_state_path(self.trainer)
        done = 0
        if state_path.is_file():
            state = torch.load(state_path, map_location=device, weights_only=True)
            try:
                reward.load_state_dict(state["reward_model"])
            except RuntimeError as err:
                raise ConfigError(f"{state_path} holds the pretraining of another reward model: "
                                  f"{str(err).splitlines()[0]}; move it away to pretrain afresh") from None
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            generator.set_state(state["generator"])
            done = min(int(state["steps_done"]), steps)
            log.warning("flow pretraining: continuing from %s at step %d of %d", state_path, done, steps)
            for _ in range(done):  # the batches an uninterrupted run would see next
                next(batches)
        self.policy.eval()
        if self.hparams.flow_pretrain_cache_latents:
            encode = ExpertLatentCache(self.policy, self.tokenizer, self.tap, device)
        else:
            encode = lambda prompts, solutions: expert_latents(  # noqa: E731
                self.policy, self.tokenizer, self.tap, prompts, solutions, device)
        progress = LoopProgress("flow pretraining", steps, initial=done, enabled=self.trainer.is_global_zero)
        with sigterm_stops() as stop:
            for step in range(done, steps):
                rows = next(batches)
                latents, mask = encode(rows["prompt"], rows["solution"])
                optimizer.zero_grad()
                loss = 0.0
                for piece in reward.pretrain_losses(latents, mask, generator):
                    value = piece()
                    value.backward()
                    loss += float(value.detach())
                optimizer.step()
                schedule.step()
                done = step + 1
                progress.update(done, loss=loss)
                if stop():
                    break
        progress.close()
        if self.trainer.is_global_zero:
            AtomicCheckpointIO().save_checkpoint(
                {"steps_done": done, "reward_model": reward.state_dict(), "optimizer": optimizer.state_dict(),
                 "schedule": schedule.state_dict(), "generator": generator.get_state()}, state_path)
        if done < steps:
            log.warning("SIGTERM during flow pretraining: saved step %d of %d to %s; run the job again with "
                        "--ckpt_path last to continue", done, steps, state_path)
            raise PretrainingPreempted()
        self.policy.train()
        log.info("flow pretraining: %d steps done, state in %s", steps, state_path)

    def training_step(self, prompts: dict[str, Any], batch_idx: int) -> None:
        hp = self.hparams
        start = time.perf_counter()
        step = int(prompts["index"])
        batch = self.engine.generate(prompts["prompt"], hp.num_samples, prompts["answer"])
        timings = {"time/generate_s": time.perf_counter() - start}
        bad = _agreed_over_ranks(["generation logits"] if self.engine.saw_nonfinite_logits else [])
        if bad:
            return self._skip(bad)
        batch = self.grade_rollouts(batch)
        outcome = group_normalized_advantage(batch.outcome_rewards, batch.group_ids, scale_rewards=hp.scale_rewards)
        offsets = self._reward_token_offsets(batch)
        batch.entropy = torch.full((batch.batch_size,), float("nan"), device=self.device)  # NaN: the row did not run
        if hp.ppo_epochs * hp.num_minibatches == 1:
            stats = self._on_policy_update(batch, outcome, offsets, step, timings)
        else:
            stats = self._score_then_update(batch, outcome, offsets, step, timings)
        if stats is None:
            return None
        self.consecutive_skips = 0
        generated = float(batch.response_mask.sum())
        metrics = {
            "train/outcome_reward": batch.outcome_rewards.mean(),
            "train/accuracy": batch.correct.float().mean(),
            "train/entropy": batch.entropy.nanmean(),
            "train/response_length": batch.response_lengths.float().mean(),
            "train/tokens_per_s": generated / (time.perf_counter() - start),
            "train/skipped_steps": float(self.skipped_steps),
            **timings,
            **stats,
        }
        if self.reward_model is not None:
            metrics.update(self.reward_model.step_metrics())
        self.log_dict({k: float(v) for k, v in metrics.items()}, batch_size=batch.batch_size)
        self.log("reward", batch.outcome_rewards.mean(), prog_bar=True, logger=False, batch_size=batch.batch_size)
        self.log("acc", batch.correct.float().mean(), prog_bar=True, logger=False, batch_size=batch.batch_size)
        return None

    def _reward_token_offsets(self, batch: RolloutBatch) -> list[int]:
        """Row r's first noise slot of the reward model: its scored tokens in rows < r (micro-batch invariance)."""
        if self.reward_model is None:
            return [0] * (batch.batch_size + 1)
        counts = self.reward_model.scored_token_counts(batch.response_mask).long().cpu()
        return [0, *torch.cumsum(counts, 0).tolist()]

    def _rewards_and_advantages(self, micro: RolloutBatch, rows: Tensor, outcome: Tensor, offsets: list[int],
                                step: int) -> None:
        """Token rewards right after the micro-batch's forward, then its rows' advantages (eq. 9)."""
        if self.reward_model is not None:
            first = int(rows[0])  # rows are contiguous here: no row is skipped with a reward model
            micro.token_rewards = self.reward_model.token_rewards(micro, step, token_offset=offsets[first])
            self.reward_model.observe(micro, first)
        micro.latents = None  # the reward model kept what it needs
        advantages = (outcome_at_last_token_advantages if self.hparams.outcome_placement == "last_token"
                      else token_advantages)
        micro.advantages = advantages(outcome[rows], micro.response_mask, micro.token_rewards, self.hparams.gamma)

    def _on_policy_update(self, batch: RolloutBatch, outcome: Tensor, offsets: list[int], step: int,
                          timings: dict[str, float]) -> dict[str, Tensor] | None:
        """``ppo_epochs × num_minibatches = 1``: one forward/backward per micro-batch gives the log-probs (old =
        their detached copy, so ρ = 1 with gradient ∇logπ), the latents and the loss."""
        start = time.perf_counter()
        denominator = aggregation_denominator(batch.response_mask, self.hparams.aggregation, self.hparams.max_new_tokens)
        stats = _Stats()
        keep = self._rows_with_gradient(outcome) if self.reward_model is None else None
        for rows in self._micro_batches(batch.batch_size, keep):
            if rows is None:
                bad = _agreed_over_ranks([])  # the other ranks check their micro-batch here
                if bad:
                    return self._skip(bad)
                self._padding_backward(batch)
                continue
            micro = _rows(batch, rows)
            logprobs, entropy, micro.latents = self._forward(micro, tap=True)
            micro.old_logprobs = logprobs.detach()
            micro.entropy = batch.entropy[rows] = _sequence_mean(entropy, micro.response_mask)
            if self.reference is not None:
                micro.ref_logprobs = self._reference_logprobs(micro)
            self._rewards_and_advantages(micro, rows, outcome, offsets, step)
            bad = _agreed_over_ranks(_nonfinite(micro))
            if bad:
                return self._skip(bad)
            manual_backward(self, self._policy_loss(micro, logprobs, denominator, stats))
        timings["time/update_s"] = time.perf_counter() - start
        self._finish_minibatch(batch, step, stats, timings, with_reward=True)
        return stats.means()

    def _score_then_update(self, batch: RolloutBatch, outcome: Tensor, offsets: list[int], step: int,
                           timings: dict[str, float]) -> dict[str, Tensor] | None:
        """Off-policy updates (μ > 1 or several minibatches): a no-grad scoring pass in micro-batches fixes the old
        log-probs, token rewards and advantages; then the minibatch updates, each in micro-batches."""
        start = time.perf_counter()
        length = batch.input_ids.shape[1]
        names = ["old_logprobs", "token_rewards", "advantages", "ref_logprobs"]
        parts: dict[str, list[Tensor]] = {name: [] for name in names}
        with torch.no_grad():
            for rows in self._micro_batches(batch.batch_size):
                micro = self._score_rows(_rows(batch, rows))
                batch.entropy[rows] = micro.entropy
                self._rewards_and_advantages(micro, rows, outcome, offsets, step)
                bad = _agreed_over_ranks(_nonfinite(micro))
                if bad:
                    return self._skip(bad)
                for name in names:
                    if getattr(micro, name) is not None:
                        parts[name].append(pad_columns(getattr(micro, name), length))
        for name in names:
            setattr(batch, name, torch.cat(parts[name]) if parts[name] else None)
        timings["time/score_s"] = time.perf_counter() - start
        start = time.perf_counter()
        stats = _Stats()
        first = True
        for _ in range(self.hparams.ppo_epochs):
            for minibatch_rows in torch.arange(batch.batch_size).chunk(self.hparams.num_minibatches):
                mini = batch.select(minibatch_rows)
                denominator = aggregation_denominator(mini.response_mask, self.hparams.aggregation,
                                                      self.hparams.max_new_tokens)
                keep = self._rows_with_gradient(mini.advantages * mini.response_mask)
                for rows in self._micro_batches(mini.batch_size, keep):
                    if rows is None:
                        self._padding_backward(mini)
                        continue
                    micro = _rows(mini, rows)
                    logprobs = self._forward(micro, tap=False)[0]
                    manual_backward(self, self._policy_loss(micro, logprobs, denominator, stats))
                self._finish_minibatch(batch, step, stats, timings, with_reward=first)
                first = False
        timings["time/update_s"] = time.perf_counter() - start - timings.get("time/flow_s", 0.0)
        return stats.means()

    def _policy_loss(self, micro: RolloutBatch, logprobs: Tensor, denominator: Tensor, stats: _Stats) -> Tensor:
        """This micro-batch's share of the minibatch loss (its sum over the minibatch's ``denominator``)."""
        hp = self.hparams
        weights = None
        if hp.rollout_is_cap is not None and micro.rollout_logprobs is not None:
            weights = torch.exp(micro.old_logprobs - micro.rollout_logprobs).clamp(max=hp.rollout_is_cap)
        loss, info = clipped_policy_loss(logprobs, micro.old_logprobs, micro.advantages, micro.response_mask,
                                         hp.clip_low, hp.clip_high, hp.aggregation, hp.clip_ratio_c, weights,
                                         denominator, hp.max_new_tokens)
        tokens = float(micro.response_mask.sum())
        stats.add("train/policy_loss", loss.detach())
        stats.add_weighted("train/clip_fraction", info["clip_fraction"], tokens)
        stats.add_weighted("train/approx_kl", info["approx_kl"], tokens)
        if self.reference is not None:
            kl = kl_penalty(logprobs, micro.ref_logprobs, micro.response_mask, hp.aggregation, denominator,
                            hp.max_new_tokens)
            stats.add("train/kl", kl.detach())
            loss = loss + hp.kl_coef * kl
        return loss

    def _finish_minibatch(self, batch: RolloutBatch, step: int, stats: _Stats, timings: dict[str, float],
                          with_reward: bool) -> None:
        """The reward model's online loss (first minibatch only, in micro-batch pieces), clipping, the step."""
        stepped = {"policy"}
        if with_reward and self.reward_model is not None:
            start = time.perf_counter()
            pieces = self.reward_model.update_losses(batch, step)
            for piece in pieces:
                manual_backward(self, piece())
            if pieces:
                stepped.add("reward")
            timings["time/flow_s"] = time.perf_counter() - start
        stats.close_minibatch()
        optimizer = self.optimizers()
        if self.hparams.max_grad_norm is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")
        step_groups(optimizer, stepped)  # the flow only moves on the minibatch that carried its loss
        optimizer.zero_grad()

    def _skip(self, bad: list[str]) -> None:
        """The ``nonfinite`` policy: fail, or drop the step (no optimizer step; gradients so far are discarded)."""
        message = f"non-finite {', '.join(bad)} at step {self.global_step}"
        if self.hparams.nonfinite == "fail":
            raise FloatingPointError(message)
        self.optimizers().zero_grad()
        if self.reward_model is not None:
            self.reward_model.step_metrics()  # drop the skipped step's partial accumulations
        self.skipped_steps += 1
        self.consecutive_skips += 1
        limit = self.hparams.max_consecutive_skips
        if limit is not None and self.consecutive_skips >= limit:
            raise FloatingPointError(f"{self.consecutive_skips} RL steps in a row were skipped (max_consecutive_skips "
                                     f"{limit}); the last one: {message}. The weights or the reward model are "
                                     "probably broken (resume from an earlier checkpoint)")
        log.warning("skipping RL step %d: non-finite %s (%d skipped so far)", self.global_step, ", ".join(bad), self.skipped_steps)
        self.log("train/skipped_steps", float(self.skipped_steps))
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """vLLM holds its own copy of the weights: sync it after the step's optimizer steps, so the next
        generation samples the policy this step produced (a collective under ZeRO-3: every rank gets here)."""
        if isinstance(self.engine, VllmRolloutEngine):
            self.engine.sync_weights(self.policy)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["skipped_steps"] = self.skipped_steps  # a resumed run keeps counting

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.skipped_steps = int(checkpoint.get("skipped_steps", 0))

    def configure_optimizers(self):
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad], "lr": self.hparams.lr, "name": "policy"}]
        if self.reward_model is not None and any(True for _ in self.reward_model.parameters()):
            groups.append({"params": list(self.reward_model.parameters()), "lr": self.hparams.flow_lr, "name": "reward"})
        return torch.optim.AdamW(groups, weight_decay=0.0)

    # ----------------------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self) -> None:
        names = getattr(self.trainer.datamodule, "val_names", None) or ["heldout"]
        k = self._val_k()
        for name in names:
            if name not in self.val_metrics:
                self.val_metrics[name] = torch.nn.ModuleDict({"pass@1": MeanMetric(), f"pass@{k}": MeanMetric()}).to(self.device)

    def _val_k(self) -> int:
        return 1 if self.hparams.val_temperature == 0 else self.hparams.val_num_samples

    def validation_step(self, prompts: dict[str, list[str]], batch_idx: int, dataloader_idx: int = 0) -> None:
        k = self._val_k()
        batch = self.engine.generate(prompts["prompt"], k, prompts["answer"], temperature=self.hparams.val_temperature)
        correct = torch.tensor([grade(r, a, self.hparams.grader_timeout) for r, a in zip(batch.responses, batch.answers)])
        per_prompt = correct.view(-1, k).sum(-1)
        name = list(self.val_metrics)[dataloader_idx]
        metrics = self.val_metrics[name]
        metrics["pass@1"].update(pass_at_k(k, per_prompt, 1))
        metrics[f"pass@{k}"].update(pass_at_k(k, per_prompt, k))
        for key, metric in metrics.items():
            self.log(f"val/{name}/{key}", metric, add_dataloader_idx=False, batch_size=len(prompts["prompt"]))

    # ----------------------------------------------------------------------------------------- artifacts
    def export_artifacts(self, directory: str | Path) -> dict[str, Path]:
        """Policy in HF format (full weights or the PEFT adapter) + tokenizer, and the flow in safetensors."""
        directory = Path(directory)
        paths = {"policy": directory / "hf_policy"}
        self.policy.save_pretrained(paths["policy"], safe_serialization=True)
        self.tokenizer.save_pretrained(paths["policy"])
        if self.reward_model is not None and hasattr(self.reward_model, "save_field"):
            paths["flow"] = directory / "flow.safetensors"
            self.reward_model.save_field(paths["flow"])
        return paths


def _check_options(reward_model: TokenRewardModel | None, num_samples: int, max_new_tokens: int, temperature: float,
                   top_p: float, outcome_reward: str, gamma: float, clip_low: float, clip_high: float, ppo_epochs: int,
                   num_minibatches: int, kl_coef: float, lr: float, flow_lr: float, max_grad_norm: float | None,
                   flow_pretrain_steps: int, flow_pretrain_batch_size: int, val_num_samples: int, val_temperature: float,
                   nonfinite: str, grader_timeout: float) -> None:
    """ConfigError for the sampling, update and pretraining options, before the backbone loads."""
    for name, value in [("num_samples", num_samples), ("max_new_tokens", max_new_tokens), ("ppo_epochs", ppo_epochs),
                        ("num_minibatches", num_minibatches), ("flow_pretrain_batch_size", flow_pretrain_batch_size),
                        ("val_num_samples", val_num_samples)]:
        check_range("PolicyModule", name, value, 1)
    for name, value in [("temperature", temperature), ("val_temperature", val_temperature), ("kl_coef", kl_coef),
                        ("clip_high", clip_high), ("flow_pretrain_steps", flow_pretrain_steps)]:
        check_range("PolicyModule", name, value, 0)
    for name, value in [("lr", lr), ("flow_lr", flow_lr), ("max_grad_norm", max_grad_norm),
                        ("grader_timeout", grader_timeout)]:
        check_range("PolicyModule", name, value, 0, open_low=True)
    check_range("PolicyModule", "top_p", top_p, 0, 1, open_low=True)
    check_range("PolicyModule", "gamma", gamma, 0, 1)
    check_range("PolicyModule", "clip_low", clip_low, 0, 1, open_high=True)  # the ratio's lower bound 1 − ε must be > 0
    if temperature == 0 and num_samples > 1:
        raise ConfigError(f"PolicyModule.temperature 0 (greedy) makes the {num_samples} samples of a prompt identical, "
                          "so every GRPO advantage is 0: use temperature > 0, or num_samples 1")
    if outcome_reward not in ("official", "binary", "none"):
        raise ConfigError(f"PolicyModule.outcome_reward must be official, binary or none, got {outcome_reward!r}")
    if nonfinite not in ("skip", "fail"):
        raise ConfigError(f"PolicyModule.nonfinite must be skip or fail, got {nonfinite!r}")
    pretrainable = reward_model is not None and hasattr(reward_model, "pretrain_losses") and bool(reward_model.percentiles)
    if flow_pretrain_steps > 0 and not pretrainable:
        raise ConfigError(f"PolicyModule.flow_pretrain_steps {flow_pretrain_steps} needs a reward_model with latents to "
                          f"pretrain (a FlowReward), got {type(reward_model).__name__ if reward_model else None}; "
                          "set flow_pretrain_steps 0")


def _check_step_options(aggregation: str, scale_rewards: str, clip_ratio_c: float | None, micro_batch_size: int | None,
                        rollout_batch_size: int | None, num_samples: int, lm_head_chunk_size: int | None,
                        rollout_is_cap: float | None, max_consecutive_skips: int | None) -> None:
    """ConfigError for the RL-step options, before the backbone loads."""
    if aggregation not in ("token-mean", "seq-mean", "dr-grpo"):
        raise ConfigError(f"PolicyModule.aggregation must be token-mean, seq-mean or dr-grpo, got {aggregation!r}")
    if scale_rewards not in ("group", "batch", "none"):
        raise ConfigError(f"PolicyModule.scale_rewards must be group, batch or none, got {scale_rewards!r}")
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ConfigError(f"PolicyModule.clip_ratio_c must be > 1 (or null), got {clip_ratio_c}")
    for name, value in [("micro_batch_size", micro_batch_size), ("lm_head_chunk_size", lm_head_chunk_size),
                        ("max_consecutive_skips", max_consecutive_skips)]:
        if value is not None and value < 1:
            raise ConfigError(f"PolicyModule.{name} must be >= 1 (or null), got {value}")
    if rollout_batch_size is not None and (rollout_batch_size < 1 or rollout_batch_size % num_samples):
        raise ConfigError(f"PolicyModule.rollout_batch_size must be a positive multiple of num_samples ({num_samples}) "
                          f"(or null), got {rollout_batch_size}")
    if rollout_is_cap is not None and not rollout_is_cap > 0:
        raise ConfigError(f"PolicyModule.rollout_is_cap must be > 0 (or null), got {rollout_is_cap}")


def _rows(batch: RolloutBatch, rows: Tensor) -> RolloutBatch:
    """Rows ``rows`` of the batch, cut after their last real token (right padding costs compute, changes nothing)."""
    micro = batch.select(rows)
    length = int(micro.attention_mask.any(0).nonzero().max()) + 1
    for name in ("input_ids", "attention_mask", "response_mask", "token_rewards", "advantages", "old_logprobs",
                 "rollout_logprobs", "ref_logprobs"):
        value = getattr(micro, name)
        if value is not None:
            setattr(micro, name, value[:, :length])
    return micro


def _sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def _nonfinite(micro: RolloutBatch) -> list[str]:
    """Names of the micro-batch's non-finite quantities (on response tokens), in a fixed order."""
    response = micro.response_mask.bool()
    checks = {"log-probs": micro.old_logprobs, "advantages": micro.advantages, "token rewards": micro.token_rewards}
    return [name for name, values in checks.items() if values is not None and not bool(torch.isfinite(values[response]).all())]


def _agreed_over_ranks(bad: list[str]) -> list[str]:
    """Ranks skip a step together: one that skipped alone would leave the others waiting in a collective (ZeRO's
    gradient reduction, the next forward's parameter gathering). Every rank checks at the same point of the step
    (ranks hold equally many rollouts, hence micro-batches)."""
    if all_reduce_int(int(bool(bad)), ReduceOp.MAX) and not bad:
        return ["values on another rank"]
    return bad


class _Stats:
    """Step statistics: ``add`` sums a micro-batch's share of a minibatch value (the loss); ``add_weighted``
    averages per-token means over micro-batches by token count; ``means`` averages over minibatches."""

    def __init__(self):
        self.current: dict[str, Tensor] = {}
        self.weighted: dict[str, list[Tensor]] = {}
        self.done: dict[str, list[Tensor]] = {}

    def add(self, name: str, value: Tensor) -> None:
        self.current[name] = self.current.get(name, 0.0) + value

    def add_weighted(self, name: str, value: Tensor, weight: float) -> None:
        total, count = self.weighted.get(name, (0.0, 0.0))
        self.weighted[name] = (total + value * weight, count + weight)

    def close_minibatch(self) -> None:
        for name, value in self.current.items():
            self.done.setdefault(name, []).append(torch.as_tensor(value))
        for name, (total, count) in self.weighted.items():
            self.done.setdefault(name, []).append(torch.as_tensor(total / max(count, 1.0)))
        self.current, self.weighted = {}, {}

    def means(self) -> dict[str, Tensor]:
        return {name: torch.stack(values).mean() for name, values in self.done.items()}
