"""The actor: the policy's forward over rollout rows (log-probs, entropies, latents, values) and its loss.

Plain PyTorch (no Lightning), as verl keeps its actor apart from the trainer. The models belong to the caller (a
LightningModule registers and optimizes them); the actor only reads them.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from flowkit.batch import RolloutBatch
from flowkit.distributed import zero3_sharded
from flowkit.step.experience import Experience
from flowkit.step.options import LossOptions, UpdateOptions
from flowkit.step.stats import StepStats
from flowkit.llm.latent_tap import LatentTap
from flowkit.llm.forward import forward_hidden
from flowkit.llm.kv_cache import forward_hidden_shared_prompts
from flowkit.llm.padding_free import PackedRows, packs_rows
from flowkit.options import registry_entry
from flowkit.rl.logprobs import lm_head_logprobs
from flowkit.rl.losses import (
    POLICY_LOSSES, aggregation_denominator, clipped_value_loss, kl_penalty, masked_aggregate, masked_sum,
)
from flowkit.rl.rollout_correction import (
    correction_fractions, correction_weights, mismatch_metrics, off_policy_sequence_mask, rollout_log_ratio,
)

REFERENCE_ADAPTER = "reference"  # the frozen LoRA adapter holding a snapshot of the policy (e.g. after SFT)


@dataclass
class ActorOutput:
    """B×S log-probs (with gradient when enabled) and entropies (detached, unless the loss has an entropy bonus) of
    the rows' tokens, the tapped latents (P×B×S×d, detached) when asked for, and the value head's V(state before
    token s) (B×S) when there is one."""

    logprobs: Tensor
    entropy: Tensor
    latents: Tensor | None = None
    values: Tensor | None = None


class KLReference:
    """The frozen reference policy π_ref of the KL term.

    Either a frozen full copy (``frozen``), or — for a LoRA policy — the policy itself read through a frozen adapter:
    the ``reference`` adapter when :meth:`snapshot` filled one (PPO's initial policy after SFT: LoRA-sized, not a model
    copy), else with its adapters disabled (the base model, which is where LoRA training starts). ``snapshot_adapter``
    adds the frozen adapter up front (before the optimizer and the strategy see the model).
    """

    def __init__(self, policy: torch.nn.Module, frozen: torch.nn.Module | None = None, snapshot_adapter: bool = False):
        self.policy, self.frozen = policy, frozen
        if frozen is None and not hasattr(policy, "peft_config"):
            raise ValueError("a KL reference without a frozen copy needs a LoRA (peft) policy")
        if frozen is not None:
            frozen.requires_grad_(False).eval()
        elif snapshot_adapter and REFERENCE_ADAPTER not in policy.peft_config:
            # the adapter's initial weights are overwritten by the snapshot: drawing them must not move the run's RNG
            with torch.random.fork_rng(devices=[]):
                policy.add_adapter(REFERENCE_ADAPTER, copy.deepcopy(policy.peft_config["default"]))

    @contextmanager
    def reading(self):
        """The model that computes π_ref while inside: the frozen copy, or the LoRA policy with the ``reference``
        adapter active (adapters disabled without one); on leaving, the trainable adapter is active again."""
        if self.frozen is not None:
            yield self.frozen
            return
        if REFERENCE_ADAPTER not in self.policy.peft_config:
            with self.policy.disable_adapter():
                yield self.policy
            return
        self.policy.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
        try:
            yield self.policy
        finally:
            self.policy.set_adapter("default")  # peft's set_adapter also makes only "default" require grad

    @torch.no_grad()
    def snapshot(self) -> None:
        """Copy the policy's current trainable weights into the reference (LoRA: the ``default`` adapter into the
        ``reference`` one; a frozen copy: every weight). Under ZeRO-3 each pair is gathered for the copy and the
        target re-partitioned from rank 0, so every rank must call it."""
        if self.frozen is not None:
            pairs = list(zip(self.policy.parameters(), self.frozen.parameters(), strict=True))
        else:
            params = dict(self.policy.named_parameters())
            pairs = [(param, params[name.replace(".default.", f".{REFERENCE_ADAPTER}.")])
                     for name, param in params.items() if "lora_" in name and ".default." in name]
        sharded = zero3_sharded(p for pair in pairs for p in pair)
        if sharded:
            import deepspeed  # sharded parameters mean DeepSpeed is installed
        for source, target in pairs:  # one parameter gathered at a time
            read = deepspeed.zero.GatheredParameters([source], modifier_rank=None) if sharded else nullcontext()
            write = deepspeed.zero.GatheredParameters([target], modifier_rank=0) if sharded else nullcontext()
            with read, write:
                target.copy_(source)


def _forward_hidden(model: torch.nn.Module, batch: RolloutBatch) -> Tensor:
    """The last hidden state with each group's prompt run once (:func:`forward_hidden_shared_prompts`) where that is
    sound: no activation checkpointing (HF's checkpointed layers), no ZeRO-3 sharding; else row by row."""
    if not (zero3_sharded(model.parameters()) or any(getattr(m, "gradient_checkpointing", False) for m in model.modules())):
        hidden = forward_hidden_shared_prompts(model, batch)
        if hidden is not None:
            return hidden
    return forward_hidden(model, batch)


def _forward_packed(model: torch.nn.Module, batch: RolloutBatch,
                    tap: LatentTap | None = None) -> tuple[Tensor, Tensor | None]:
    """The last hidden state over the batch's rows packed into one sequence (:mod:`flowkit.llm.padding_free`) and,
    with ``tap``, the latents; both back in B×S layout (zeros on padding), so the LM head, the value head and the
    reward model read them as the padded pass's."""
    packed = PackedRows.of(batch.attention_mask)
    with tap or nullcontext():
        hidden = packed.forward_hidden(model, batch.input_ids)
    return hidden, None if tap is None else packed.unpack(tap.latents[:, 0])


class Actor:
    """Forward passes of the policy over rollout rows, and the per-micro-batch loss (verl's ``compute_log_prob`` /
    ``update_policy`` split, here per micro-batch so the caller owns the loop, the backward and the step).

    Args:
        policy: the causal LM being trained (HF or peft).
        tap: the latent tap on ``policy`` (a reward model that reads latents), or None.
        value_head: Linear(d → 1) on the last hidden state for the ``gae`` estimator, or None.
        reference: the KL reference, or None (no KL).
        update, loss: the option groups.
    """

    def __init__(self, policy: torch.nn.Module, tap: LatentTap | None, value_head: torch.nn.Module | None,
                 reference: KLReference | None, update: UpdateOptions, loss: LossOptions):
        self.policy, self.tap, self.value_head, self.reference = policy, tap, value_head, reference
        self.update, self.options = update, loss

    @property
    def device(self) -> torch.device:
        """Where the policy's weights are, and the rows it reads must be."""
        return next(self.policy.parameters()).device

    def forward(self, batch: RolloutBatch, tap: bool = False, temperature: float | None = None) -> ActorOutput:
        """Log-probs through the LM head in chunks (never B×S×V logits) at ``temperature`` (default: the sampling
        temperature), entropies, the latents (with ``tap``) and the values (with a value head) of ``batch``'s rows."""
        if self.padding_free:
            hidden, latents = _forward_packed(self.policy, batch, self.tap if tap else None)
        elif self.tap is not None:  # every forward of a tapped policy runs alike: an on-policy ratio is exactly 1
            with self.tap if tap else nullcontext():
                hidden = forward_hidden(self.policy, batch)
            latents = self.tap.latents if tap else None
        else:
            hidden, latents = _forward_hidden(self.policy, batch), None
        temperature = (self.update.temperature or 1.0) if temperature is None else temperature
        logprobs, entropy = lm_head_logprobs(hidden, self.policy.get_output_embeddings(), batch.input_ids,
                                             batch.response_mask, temperature, self.update.lm_head_chunk_size,
                                             entropy_gradient=self.options.entropy_coef > 0)
        values = None
        if self.value_head is not None:
            # V(state before token s) sits at position s − 1; the head runs in its own dtype (bf16 under DeepSpeed)
            head = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
            values = torch.nn.functional.pad(head[:, :-1], (1, 0)) * batch.response_mask
        return ActorOutput(logprobs, entropy, latents, values)

    @torch.no_grad()
    def reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        with self.reference.reading() as model:
            hidden = _forward_packed(model, batch)[0] if self._packs(model) else _forward_hidden(model, batch)
            return lm_head_logprobs(hidden, model.get_output_embeddings(), batch.input_ids, batch.response_mask,
                                    self.update.temperature or 1.0, self.update.lm_head_chunk_size)[0]

    def _packs(self, model: torch.nn.Module) -> bool:
        """Whether forwards of ``model`` run padding-free: ``update.padding_free`` and a model whose attention keeps
        packed rows apart (:func:`~flowkit.llm.padding_free.packs_rows`); else padded (with shared prompts where
        sound, :func:`_forward_hidden`)."""
        return self.update.padding_free and packs_rows(model)

    @property
    def padding_free(self) -> bool:
        """Whether the policy's forwards run padding-free (micro-batches then pack real tokens to their budget)."""
        return self._packs(self.policy)

    def loss(self, micro: Experience, out: ActorOutput, denominator: Tensor, tokens: Tensor,
             stats: StepStats) -> Tensor:
        """This micro-batch's share of its minibatch's loss (π_old: the experience's, or without a scoring pass this
        forward's own log-probs, detached): the policy loss (``policy_loss``: ``ppo``, ``gspo``,
        ``cispo`` or another registered one, :data:`~flowkit.rl.losses.POLICY_LOSSES`) summed over the micro-batch and divided by the
        minibatch's aggregation ``denominator``; − entropy_coef × the token entropy, aggregated alike (verl's
        ``entropy_coeff``); + kl_coef × the KL term (KL in the loss); + vf_coef × the clipped value loss over the
        minibatch's ``tokens`` (``gae``). The shares add up to the minibatch loss whatever the micro-batch size."""
        options = self.options
        old_logprobs = out.logprobs.detach() if micro.old_logprobs is None else micro.old_logprobs
        if micro.entropy is None:  # no scoring pass: this forward measures the entropy of the rows it trains on
            rows = float(aggregation_denominator(micro.loss_mask, "seq-mean"))
            if micro.loss_mask.any():
                stats.add_weighted("train/entropy",
                                   masked_aggregate(out.entropy.detach(), micro.loss_mask, "seq-mean"), rows)
        anchor, weights = old_logprobs, None
        if micro.rollout_logprobs is not None:
            anchor, weights = self._rollout_correction(micro, old_logprobs, out, stats)
        policy_loss = registry_entry(POLICY_LOSSES, options.policy_loss).fn
        loss, info = policy_loss(out.logprobs, anchor, micro.advantages, micro.loss_mask,
                                 options.context(weights, denominator))
        count = float(micro.loss_mask.sum())
        stats.add("train/policy_loss", loss.detach())
        stats.add_weighted("train/clip_fraction", info["clip_fraction"], count)
        stats.add_weighted("train/approx_kl", info["approx_kl"], count)
        if options.entropy_coef > 0:
            entropy = masked_sum(out.entropy, micro.loss_mask, options.aggregation) / denominator
            stats.add("train/entropy_loss", -entropy.detach())
            loss = loss - options.entropy_coef * entropy
        if self.reference is not None and options.kl_in == "loss":
            kl = kl_penalty(out.logprobs, micro.ref_logprobs, micro.loss_mask, options.aggregation, denominator,
                            options.max_new_tokens, options.kl_estimator)
            stats.add("train/kl", kl.detach())
            loss = loss + options.kl_coef * kl
        if out.values is not None:
            value_loss = clipped_value_loss(out.values, micro.old_values, micro.returns, micro.loss_mask,
                                            options.value_clip, tokens)
            stats.add("train/value_loss", value_loss.detach())
            loss = loss + options.vf_coef * value_loss
        return loss

    def _rollout_correction(self, micro: Experience, old_logprobs: Tensor, out: ActorOutput,
                            stats: StepStats) -> tuple[Tensor, Tensor | None]:
        """PPO's anchor log-probs (the trainer's π_old, or π_rollout in bypass mode) and the detached per-token
        weights of ``rollout_correction`` (:mod:`flowkit.rl.rollout_correction`) for a micro-batch whose engine
        returned its sampler's log-probs; logs the rollout / trainer mismatch (``rollout_corr/...``) either way."""
        correction, mask = self.options.rollout_correction, micro.loss_mask
        rollout = micro.rollout_logprobs
        log_ratio = rollout_log_ratio(old_logprobs, rollout, mask)
        count = float(mask.sum())
        gap = mismatch_metrics(old_logprobs, rollout, mask)
        stats.add_weighted("rollout_corr/abs_diff_mean", gap["abs_diff_mean"], count)
        stats.add_weighted("rollout_corr/k3_kl", gap["k3_kl"], count)
        stats.add_max("rollout_corr/abs_diff_max", gap["abs_diff_max"])
        weights = None
        if correction.mode is not None:
            weights = correction_weights(log_ratio, mask, correction.mode, correction.upper, correction.lower)
            stats.add_weighted("rollout_corr/weight_mean", masked_aggregate(weights, mask, "token-mean"), count)
            rows = float(mask.any(-1).sum())
            for name, fraction in correction_fractions(log_ratio, mask, correction.mode, correction.upper,
                                                       correction.lower).items():
                stats.add_weighted(f"rollout_corr/{name}", fraction, rows if name.startswith("seq_") else count)
        if correction.off_policy_mask is not None:
            keep = off_policy_sequence_mask(out.logprobs, rollout, micro.advantages, mask, correction.off_policy_mask)
            stats.add_weighted("rollout_corr/off_policy_masked_frac",
                               masked_aggregate(1 - keep, mask, "token-mean"), count)
            weights = keep if weights is None else weights * keep
        return (rollout if correction.bypass else old_logprobs), weights

    def sft_loss(self, micro: RolloutBatch, tokens: Tensor) -> Tensor:
        """Supervised fine-tuning: the negative log-likelihood of the micro-batch's response tokens, summed and divided
        by ``tokens`` (the whole step's response tokens: the micro-batches' shares add up to the token mean), through
        the same chunked LM head as RL."""
        return -(self.forward(micro, temperature=1.0).logprobs * micro.response_mask).sum() / tokens

    @staticmethod
    def padding_loss(out: ActorOutput) -> Tensor:
        """A zero loss through the :meth:`forward` ``out`` of one row, reaching every trained module the real
        micro-batches reach: this rank's share of a backward that other ranks still run (a collective under DDP and
        ZeRO)."""
        loss = out.logprobs.sum() * 0.0
        return loss if out.values is None else loss + out.values.sum() * 0.0
