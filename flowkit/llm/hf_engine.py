"""flowkit's own rollout engine: HF ``generate``'s sampling as a decoding loop over the trained model itself, rows
leaving the batch as they end.

Layout: each row is ``[left padding][prompt][response][right padding]`` — the layout HF ``generate``
produces (:mod:`flowkit.batch`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor
from torch.distributed import ReduceOp
from transformers import (
    DynamicCache, PreTrainedModel, PreTrainedTokenizerBase, TemperatureLogitsWarper, TopPLogitsWarper,
)

from flowkit.batch import RolloutBatch
from flowkit.distributed import all_reduce_int, zero3_sharded
from flowkit.llm.decode_step import decode_step_for
from flowkit.llm.forward import position_ids
from flowkit.llm.kv_cache import cache_argument, prompt_cache, recomputed_cache
from flowkit.llm.packing import pack_rollouts
from flowkit.llm.rollout_engine import TokenRollouts


def _zero3_partitioned(model: torch.nn.Module) -> bool:
    """DeepSpeed ZeRO-3 shards parameters (marking them with ``ds_id``) and gathers them in every forward,
    a collective: with several ranks, all must keep stepping until every rank's generation is done."""
    multi_rank = torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    return multi_rank and zero3_sharded(model.parameters())


def _next_token_scores(logits: Tensor, temperature: float, top_p: float) -> tuple[Tensor, bool]:
    """fp32 next-token scores as HF ``generate`` samples from them (temperature, then nucleus filtering; top-k off),
    and whether any logit was NaN or inf — replaced by finite values so sampling goes on and the caller applies its
    own non-finite policy afterwards."""
    scores = logits.float()
    # a NaN or inf anywhere makes the sum non-finite: one pass without a B×V mask, the exact check only then (finite
    # logits may also sum past 3e38)
    nonfinite = not bool(torch.isfinite(scores.sum())) and not bool(torch.isfinite(scores).all())
    if nonfinite:
        scores = torch.nan_to_num(scores, nan=0.0, posinf=torch.finfo(scores.dtype).max,
                                  neginf=torch.finfo(scores.dtype).min)
    if temperature > 0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
    return scores, nonfinite


def sample_from(probs: Tensor) -> Tensor:
    """One token per row of ``probs`` (B × V, rows summing to 1), drawn with the probabilities of a categorical
    distribution by inverting its CDF: one uniform per row against the row's cumulative sum, in float64 so that
    tokens far below the float32 resolution of a running sum near 1 keep their share, and a token of probability 0
    is never drawn. ``torch.multinomial`` draws the same distribution through an exponential variate per vocabulary
    entry: 7–15 ms for 32 rows × 32k on a CPU thread, against well under 1 ms here."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    # u < total exactly (rand × total may round up to it), so a row's last token of non-zero probability bounds it
    u = torch.minimum(torch.rand(total.shape, dtype=torch.float64, device=probs.device) * total,
                      torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True)[:, 0]


class HFRolloutEngine:
    """Samples ``n`` responses per prompt with an HF model and packs them into a :class:`RolloutBatch` (the ``hf``
    engine of :mod:`flowkit.llm.engines`: it runs the policy itself, so new weights need no push).

    The decoding loop samples HF ``generate``'s distribution (fp32 scores, temperature, nucleus, no top-k, no
    repetition penalty or other defaults of the model's ``generation_config``: the loss scores rollouts under the full
    tempered softmax; drawn by :func:`sample_from`, not ``torch.multinomial``) with the prompt encoded once per group
    and finished rows dropped from the batch (see :meth:`_sample`).

    Args:
        rollout_batch_size: sequences (prompts × n) per decoding batch, which bounds the KV cache; a multiple
            of ``n`` (whole groups per call). None: all prompts in one call.
        whole_weights: a context in which the model's weights are whole and its forwards run no collective
            (:func:`flowkit.strategies.whole_weights_for_generation` under ZeRO-3); generation then runs inside it,
            each rank at its own pace. None: under ZeRO-3 each decoding step gathers the weights, and ranks step in
            lockstep (as ``generate``'s ``synced_gpus``).

    After each :meth:`generate`, :attr:`saw_nonfinite_logits` says whether any next-token score was NaN or
    inf (the sequences are then garbage; the policy module skips or fails the step). ``rollout_logprobs`` holds the
    log-probability of each sampled token under the distribution it was drawn from (after temperature and top-p, as
    vLLM's processed log-probs; greedy: the plain softmax): the trainer's forward reproduces it up to numerics,
    which the step logs as ``rollout_corr/...``.

    ``held_version`` (the rollout server's partial rollouts): called before each decoding step, it returns the policy
    version of the weights that step samples from, after letting a weight push due meanwhile land in the model; when it
    changed, the KV cache of the rows still decoding is computed anew under the new weights (one pass over their prompt
    and what they generated), so each token is sampled, and its log-prob taken, as the new weights alone would. The
    server generates through :meth:`generate_from_ids`, whose versions are per token; :meth:`generate` (the
    colocated engine, whose weights change only between generations) tags each row with :attr:`policy_version`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_new_tokens: int = 1024,
        temperature: float = 1.0,
        top_p: float = 1.0,
        rollout_batch_size: int | None = None,
        whole_weights: Callable[[], AbstractContextManager] | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.whole_weights = whole_weights
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.rollout_batch_size = rollout_batch_size
        self.saw_nonfinite_logits = False
        self.policy_version = 0
        self.held_version: Callable[[], int] | None = None

    def sync_weights(self, model: PreTrainedModel, version: int) -> None:
        """The engine samples from ``model`` itself: only the version changes."""
        self.model, self.policy_version = model, version

    def close(self) -> None:
        """Nothing to release: the model belongs to the trainer."""

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        n: int = 1,
        answers: list[str] | None = None,
        temperature: float | None = None,
    ) -> RolloutBatch:
        """``n`` samples per prompt (rows grouped: prompt i → rows i·n … i·n+n−1); temperature 0 is greedy."""
        temperature = self.temperature if temperature is None else temperature
        self.saw_nonfinite_logits = False
        per_call = len(prompts) if self.rollout_batch_size is None else max(1, self.rollout_batch_size // n)
        chunks = [self._generate(prompts[i:i + per_call], n, answers[i:i + per_call] if answers is not None else None,
                                 temperature) for i in range(0, len(prompts), per_call)]
        if len(chunks) == 1:
            return chunks[0]
        batch = RolloutBatch.cat(chunks)
        batch.group_ids = torch.arange(len(prompts), device=batch.group_ids.device).repeat_interleave(n)
        return batch

    @property
    def lockstep(self) -> bool:
        """Whether each generation is a collective (the weights are ZeRO-3 shards: it gathers them whole once, or, with
        no ``whole_weights``, in every decoding step), so every rank calls :meth:`generate_from_ids` together, with no
        prompts when it has none."""
        return _zero3_partitioned(self.model)

    @torch.no_grad()
    def generate_from_ids(self, prompts: list[list[int]], max_new_tokens: list[int],
                          temperature: float | None = None, n: int = 1) -> TokenRollouts:
        """Token-in/token-out (:class:`~flowkit.llm.rollout_engine.TokenInEngine`): ``n`` samples of each prompt
        (prompt i → rows i·n … i·n+n−1; one for the episode runner, the prompt encoded once per group), each row's
        sampled ids (through EOS, or cut at its prompt's ``max_new_tokens``, at most the engine's), each one's
        log-probability under the sampler and the policy version that sampled it (:attr:`held_version`'s, else the
        engine's). No prompts: nothing, after decoding alongside the other ranks under :attr:`lockstep`."""
        temperature = self.temperature if temperature is None else temperature
        self.saw_nonfinite_logits = False
        if not prompts and not self.lockstep:
            return TokenRollouts([], [], [])
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id
        # a rank with nothing to generate decodes one row of a pad token, finished at once, for the collectives
        rows, limits = (prompts, [min(limit, self.max_new_tokens) for limit in max_new_tokens for _ in range(n)]) \
            if prompts else ([[pad]], [0])
        width = max(map(len, rows))
        encoded = {"input_ids": torch.tensor([[pad] * (width - len(ids)) + ids for ids in rows], device=device),
                   "attention_mask": torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows],
                                                  device=device)}
        generated, logprobs, step_versions = self._decode(encoded, n if prompts else 1, temperature,
                                                          torch.tensor(limits, device=device))
        eos, rollouts = self.tokenizer.eos_token_id, TokenRollouts([], [], [])
        for row, (ids, limit) in enumerate(zip(generated.tolist(), limits) if prompts else ()):
            length = min(ids.index(eos) + 1 if eos in ids else len(ids), limit)
            rollouts.ids.append(ids[:length])
            rollouts.logprobs.append(logprobs[row, :length].tolist())
            rollouts.versions.append(step_versions[:length])
        return rollouts

    def _generate(self, prompts: list[str], n: int, answers: list[str] | None, temperature: float) -> RolloutBatch:
        device = next(self.model.parameters()).device
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
        limits = torch.full((len(prompts) * n,), self.max_new_tokens, device=device)
        generated, sampler_logprobs, _ = self._decode(encoded, n, temperature, limits)
        batch = pack_rollouts(self.tokenizer, encoded, generated, prompts, n, answers, sampler_logprobs)
        batch.policy_versions = torch.full((batch.batch_size,), self.policy_version, device=device)
        return batch

    def _decode(self, encoded: dict[str, Tensor], n: int, temperature: float,
                limits: Tensor) -> tuple[Tensor, Tensor, list[int]]:
        """``n`` samples of each left-padded prompt of ``encoded``, sample j at most ``limits[j]`` tokens: their
        tokens, sampler log-probs and each step's policy version (:meth:`_sample`), the policy in eval mode
        meanwhile."""
        was_training = self.model.training
        self.model.eval()
        synced = self.lockstep and self.whole_weights is None
        # ranks decoding in lockstep may step past their own rows' limits, up to the engine's bound, for the others
        max_new_tokens = self.max_new_tokens if synced else int(limits.max())
        shared = n > 1 and encoded["input_ids"].shape[1] > 1
        if synced:  # the prefill is a forward, a collective under ZeRO-3: every rank runs it or none
            shared = bool(all_reduce_int(int(shared), ReduceOp.MIN))
        # inference mode skips autograd's bookkeeping per op; not under ZeRO-3, whose forwards gather parameters
        # (what they create in inference mode could not be saved for backward in the training forward)
        decoding = torch.no_grad() if zero3_sharded(self.model.parameters()) else torch.inference_mode()
        with (self.whole_weights or nullcontext)(), decoding:
            cache, pending = prompt_cache(self.model, encoded, n, shared,
                                           encoded["input_ids"].shape[1] + max_new_tokens)
            generated, sampler_logprobs, step_versions = self._sample(
                cache, pending, encoded["input_ids"].repeat_interleave(n, dim=0),
                encoded["attention_mask"].repeat_interleave(n, dim=0), temperature, synced, limits, max_new_tokens)
        self.model.train(was_training)
        # out of inference mode: tensors the training forward may use
        return generated.clone(), sampler_logprobs.clone(), step_versions

    def _sample(self, cache: DynamicCache, pending: Tensor, prompt_ids: Tensor, attention_mask: Tensor,
                temperature: float, synced: bool, limits: Tensor,
                max_new_tokens: int) -> tuple[Tensor, Tensor, list[int]]:
        """Decodes up to ``max_new_tokens`` steps, row j up to ``limits[j]`` tokens: the tokens and their log-probs
        under the sampler (B × steps taken; padding after EOS or the limit), and the policy version each step sampled
        from (:attr:`held_version`). Rows that emitted EOS or reached their limit leave the batch and the KV cache
        (once an eighth of the batch has ended: dropping rows copies the cache), so the long tail of a batch decodes
        only its own rows (HF ``generate`` decodes finished rows until the last one ends). One token per row runs
        through :class:`~flowkit.llm.decode_step.DecodeStep` where the model allows (HF's logits, less its Python).
        ``synced`` (ZeRO-3 without whole weights): every forward is a collective, so finished rows stay and the ranks
        decode until every rank's rows have ended."""
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        name = cache_argument(self.model.get_decoder())
        decode_step = decode_step_for(self.model)  # HF's forward where None
        rows = torch.arange(len(pending), device=pending.device)  # the generated row of each row still decoding
        unfinished = torch.ones_like(rows, dtype=torch.bool)
        generated = torch.full((len(rows), max_new_tokens), pad, dtype=torch.long, device=pending.device)
        logprobs = torch.zeros(generated.shape, device=pending.device)
        positions = position_ids(attention_mask)[:, -pending.shape[1]:]
        steps, step_versions = 0, []
        while steps < max_new_tokens:
            version = self.policy_version if self.held_version is None else self.held_version()
            if step_versions and version != step_versions[-1]:  # new weights: every position but the pending one
                cache = recomputed_cache(self.model, torch.cat([prompt_ids[rows], generated[rows, :steps - 1]], 1),
                                         attention_mask[:, :-1], prompt_ids.shape[1] + max_new_tokens)
                decode_step = decode_step_for(self.model)
            step_versions.append(version)
            if decode_step is not None and pending.shape[1] == 1:
                logits = decode_step(pending, attention_mask, positions, cache)
            else:
                logits = self.model(input_ids=pending, attention_mask=attention_mask, position_ids=positions,
                                    use_cache=True, logits_to_keep=1, **{name: cache}).logits[:, -1]
            scores, nonfinite = _next_token_scores(logits, temperature, self.top_p)
            self.saw_nonfinite_logits |= nonfinite
            if temperature > 0:
                probs = torch.softmax(scores, dim=-1)
                tokens = sample_from(probs)
                token_logprobs = probs.gather(-1, tokens[:, None])[:, 0].log()
            else:
                tokens = scores.argmax(-1)
                token_logprobs = scores.gather(-1, tokens[:, None])[:, 0] - scores.logsumexp(-1)
            tokens = torch.where(unfinished, tokens, pad)
            generated[rows, steps] = tokens
            logprobs[rows, steps] = token_logprobs
            steps += 1
            unfinished &= limits[rows] > steps
            if eos is not None:
                unfinished &= tokens != eos
            running = int(unfinished.sum()) if not synced else all_reduce_int(int(bool(unfinished.any())), ReduceOp.MAX)
            if not running:
                break
            if not synced and (len(rows) - running) * 8 >= len(rows):
                keep = unfinished.nonzero().flatten()
                cache.batch_select_indices(keep)
                rows, tokens, positions = rows[keep], tokens[keep], positions[keep]
                attention_mask, unfinished = attention_mask[keep], unfinished[keep]
            pending, positions = tokens[:, None], positions[:, -1:] + 1
            attention_mask = torch.cat([attention_mask, torch.ones_like(pending)], dim=1)
        return generated[:, :steps], logprobs[:, :steps], step_versions
