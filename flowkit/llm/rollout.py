"""Rollout generation and (prompt, response) encoding into :class:`RolloutBatch` layout.

Layout: each row is ``[left padding][prompt][response][right padding]`` — the layout HF ``generate``
produces. Positions are derived from the attention mask (see :func:`position_ids`), so a forward over a
batch gives the same logits as the generation did.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor
from torch.distributed import ReduceOp
from transformers import (
    DynamicCache, PreTrainedModel, PreTrainedTokenizerBase, TemperatureLogitsWarper, TopPLogitsWarper,
)
from transformers.cache_utils import DynamicLayer

from flowkit.batch import RolloutBatch
from flowkit.distributed import all_reduce_int, zero3_sharded
from flowkit.llm.latent_tap import LatentTap


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_logits(model: torch.nn.Module, batch: RolloutBatch) -> Tensor:
    """Logits of ``model`` over the batch's sequences, positioned as during generation."""
    return model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids(batch.attention_mask)
    ).logits


def forward_hidden(model: torch.nn.Module, batch: RolloutBatch) -> Tensor:
    """Last hidden state (B×S×d) of a causal LM over the batch, positioned as during generation, without
    the LM head: callers put only the positions they need through ``model.get_output_embeddings()`` (see
    :func:`flowkit.rl.logprobs.lm_head_logprobs`). Works through PEFT wrappers, whose injected LoRA layers
    live inside the decoder. Assumes logits = lm_head(hidden) (true of Llama / Qwen / Mistral-style models;
    not of models that soft-cap or rescale logits after the head)."""
    return model.get_decoder()(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids(batch.attention_mask)
    ).last_hidden_state


def forward_hidden_shared_prompts(model: torch.nn.Module, batch: RolloutBatch) -> Tensor | None:
    """:func:`forward_hidden` running each group's prompt once: the rows of a group (same ``group_ids``) share their
    prompt columns, so the decoder runs over them once per group into a KV cache that every row of the group then
    reads (indexing it is differentiable: the rows' gradients add up in the shared prompt's). With 8 samples per
    prompt the prompt's forward and backward cost 1/8 of a row-by-row pass. B×S like :func:`forward_hidden`, zeros
    in the prompt columns (only response tokens' log-probs and values are read; a response token's comes from the
    column before it, the prompt's last, which runs with the responses). None when no two rows share a prompt.

    Not for forwards whose hooks read every layer's output (a latent tap), nor for activation checkpointing or
    ZeRO-3, whose recomputation and parameter gathering assume one decoder pass per forward."""
    starts = batch.response_mask.argmax(-1)  # first response column of each row
    prefix = int(starts.min()) - 1 if bool(batch.response_mask.any(-1).all()) else 0  # columns the cache holds
    groups, inverse = torch.unique(batch.group_ids, return_inverse=True)
    if prefix < 1 or len(groups) == batch.batch_size:
        return None
    rows = torch.arange(batch.batch_size, device=inverse.device)
    first = torch.full_like(groups, batch.batch_size).scatter_reduce(0, inverse, rows, "amin")  # one row per group
    ids, mask = batch.input_ids[:, :prefix], batch.attention_mask[:, :prefix]
    if not (torch.equal(ids, ids[first][inverse]) and torch.equal(mask, mask[first][inverse])):
        return None  # a group whose rows were encoded apart (other padding): no shared columns to rely on
    cache = _prefill(model, DynamicCache(config=model.config), ids[first], mask[first])
    cache.batch_select_indices(inverse)
    decoder = model.get_decoder()
    hidden = decoder(input_ids=batch.input_ids[:, prefix:], attention_mask=batch.attention_mask, use_cache=True,
                     position_ids=position_ids(batch.attention_mask)[:, prefix:],
                     **{_cache_argument(decoder): cache}).last_hidden_state
    return torch.nn.functional.pad(hidden, (0, 0, prefix, 0))


def _zero3_partitioned(model: torch.nn.Module) -> bool:
    """DeepSpeed ZeRO-3 shards parameters (marking them with ``ds_id``) and gathers them in every forward,
    a collective: with several ranks, all must keep stepping until every rank's generation is done."""
    multi_rank = torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    return multi_rank and zero3_sharded(model.parameters())


def _response_mask(generated: Tensor, eos_token_id: int | None) -> Tensor:
    """1 on generated tokens up to and including the first EOS."""
    if eos_token_id is None:
        return torch.ones_like(generated, dtype=torch.float32)
    is_eos = generated == eos_token_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after_eos).float()


def _next_token_scores(logits: Tensor, temperature: float, top_p: float) -> tuple[Tensor, bool]:
    """fp32 next-token scores as HF ``generate`` samples from them (temperature, then nucleus filtering; top-k off),
    and whether any logit was NaN or inf — replaced by finite values so sampling goes on and the caller applies its
    own non-finite policy afterwards."""
    scores = logits.float()
    nonfinite = not bool(torch.isfinite(scores).all())
    if nonfinite:
        scores = torch.nan_to_num(scores, nan=0.0, posinf=torch.finfo(scores.dtype).max,
                                  neginf=torch.finfo(scores.dtype).min)
    if temperature > 0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
    return scores, nonfinite


def _cache_argument(decoder: torch.nn.Module) -> str:
    """The KV-cache keyword of this transformers version: ``cache`` (5.2x) or ``past_key_values`` (earlier)."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def _prompt_cache(model: PreTrainedModel, encoded: dict[str, Tensor], n: int, shared: bool,
                  capacity: int) -> tuple[DynamicCache, Tensor]:
    """An empty decoding cache (room for ``capacity`` positions) and the ``n`` copies per prompt of every prompt
    token — or, ``shared``, a cache holding every prompt token but the last, filled by one decoder pass per prompt and
    repeated ``n`` times (1/n of the prompt's compute; the samples are those of ``n`` copies, same logits and sampler
    draws), and the prompts' last tokens."""
    input_ids = encoded["input_ids"].repeat_interleave(n, dim=0)
    cache = _decoding_cache(model, capacity)
    if not shared:
        return cache, input_ids
    _prefill(model, cache, encoded["input_ids"][:, :-1], encoded["attention_mask"][:, :-1])
    cache.batch_repeat_interleave(n)
    return cache, input_ids[:, -1:]


class _ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose positions are reserved up front: each decoding step writes its key and value
    into the buffer instead of concatenating a copy of the whole cache (``DynamicLayer``). ``keys`` / ``values`` are
    views of the filled positions, so everything else a ``DynamicLayer`` does works unchanged. Decoding only (an
    in-place write would invalidate what autograd saved of an earlier pass)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            shape = (*key_states.shape[:-2], self.capacity, key_states.shape[-1])
            self.key_buffer, self.value_buffer = key_states.new_empty(shape), value_states.new_empty(shape)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache reserved for {self.capacity} positions, asked for {end}")
        self.key_buffer[..., start:end, :] = key_states
        self.value_buffer[..., start:end, :] = value_states
        self.keys, self.values = self.key_buffer[..., :end, :], self.value_buffer[..., :end, :]
        return self.keys, self.values

    def _rebuffer(self, select: Callable[[Tensor], Tensor]) -> None:
        if self.is_initialized:
            length = self.get_seq_length()
            self.key_buffer, self.value_buffer = select(self.key_buffer), select(self.value_buffer)
            self.keys, self.values = self.key_buffer[..., :length, :], self.value_buffer[..., :length, :]

    def batch_select_indices(self, indices: Tensor) -> None:
        self._rebuffer(lambda buffer: buffer[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rebuffer(lambda buffer: buffer.repeat_interleave(repeats, dim=0))


def _decoding_cache(model: PreTrainedModel, capacity: int) -> DynamicCache:
    """The model's ``DynamicCache`` with its full-attention layers reserving ``capacity`` positions (sliding-window
    and other layer kinds as transformers builds them)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [_ReservedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _prefill(model: PreTrainedModel, cache: DynamicCache, input_ids: Tensor, attention_mask: Tensor) -> DynamicCache:
    """``cache`` filled with the KV of ``input_ids`` (left-padded rows, positioned as during generation) by one
    decoder pass."""
    decoder = model.get_decoder()
    decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
            use_cache=True, **{_cache_argument(decoder): cache})
    return cache


class HFRolloutEngine:
    """Samples ``n`` responses per prompt with an HF model and packs them into a :class:`RolloutBatch` (the ``hf``
    engine of :mod:`flowkit.llm.engines`: it runs the policy itself, so new weights need no push).

    The decoding loop is HF ``generate``'s sampling (fp32 scores, temperature, nucleus, no top-k, no repetition
    penalty or other defaults of the model's ``generation_config``: the loss scores rollouts under the full tempered
    softmax) with the prompt encoded once per group and finished rows dropped from the batch (see :meth:`_sample`).

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

    def _generate(self, prompts: list[str], n: int, answers: list[str] | None, temperature: float) -> RolloutBatch:
        device = next(self.model.parameters()).device
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
        was_training = self.model.training
        self.model.eval()
        synced = _zero3_partitioned(self.model) and self.whole_weights is None
        shared = n > 1 and encoded["input_ids"].shape[1] > 1
        if synced:  # the prefill is a forward, a collective under ZeRO-3: every rank runs it or none
            shared = bool(all_reduce_int(int(shared), ReduceOp.MIN))
        # inference mode skips autograd's bookkeeping per op; not under ZeRO-3, whose forwards gather parameters
        # (what they create in inference mode could not be saved for backward in the training forward)
        decoding = torch.no_grad() if zero3_sharded(self.model.parameters()) else torch.inference_mode()
        with (self.whole_weights or nullcontext)(), decoding:
            cache, pending = _prompt_cache(self.model, encoded, n, shared,
                                           encoded["input_ids"].shape[1] + self.max_new_tokens)
            generated, sampler_logprobs = self._sample(cache, pending, encoded["attention_mask"].repeat_interleave(n, dim=0),
                                                       temperature, synced)
        # out of inference mode: tensors the training forward may use
        generated, sampler_logprobs = generated.clone(), sampler_logprobs.clone()
        self.model.train(was_training)
        batch = pack_rollouts(self.tokenizer, encoded, generated, prompts, n, answers, sampler_logprobs)
        batch.policy_versions = torch.full((batch.batch_size,), self.policy_version, device=device)
        return batch

    def _sample(self, cache: DynamicCache, pending: Tensor, attention_mask: Tensor, temperature: float,
                synced: bool) -> tuple[Tensor, Tensor]:
        """Decodes up to ``max_new_tokens`` per row: the tokens and their log-probs under the sampler (B × steps taken;
        padding after EOS). Rows that emitted EOS leave
        the batch and the KV cache (once an eighth of the batch has ended: dropping rows copies the cache), so the long
        tail of a batch decodes only its own rows (HF ``generate`` decodes finished rows until the last one ends).
        ``synced`` (ZeRO-3 without whole weights): every forward is a collective, so finished rows stay and the ranks
        decode until every rank's rows have ended."""
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        name = _cache_argument(self.model.get_decoder())
        rows = torch.arange(len(pending), device=pending.device)  # the generated row of each row still decoding
        unfinished = torch.ones_like(rows, dtype=torch.bool)
        generated = torch.full((len(rows), self.max_new_tokens), pad, dtype=torch.long, device=pending.device)
        logprobs = torch.zeros(generated.shape, device=pending.device)
        positions = position_ids(attention_mask)[:, -pending.shape[1]:]
        steps = 0
        while steps < self.max_new_tokens:
            logits = self.model(input_ids=pending, attention_mask=attention_mask, position_ids=positions,
                                use_cache=True, logits_to_keep=1, **{name: cache}).logits[:, -1]
            scores, nonfinite = _next_token_scores(logits, temperature, self.top_p)
            self.saw_nonfinite_logits |= nonfinite
            if temperature > 0:
                probs = torch.softmax(scores, dim=-1)
                tokens = torch.multinomial(probs, 1)[:, 0]
                token_logprobs = probs.gather(-1, tokens[:, None])[:, 0].log()
            else:
                tokens = scores.argmax(-1)
                token_logprobs = scores.gather(-1, tokens[:, None])[:, 0] - scores.logsumexp(-1)
            tokens = torch.where(unfinished, tokens, pad)
            generated[rows, steps] = tokens
            logprobs[rows, steps] = token_logprobs
            steps += 1
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
        return generated[:, :steps], logprobs[:, :steps]


def pack_rollouts(tokenizer: PreTrainedTokenizerBase, encoded: dict[str, Tensor], generated: Tensor, prompts: list[str],
                  n: int, answers: list[str] | None, rollout_logprobs: Tensor | None = None) -> RolloutBatch:
    """Rows ``[left-padded prompt][response up to and including EOS][padding]``, ``n`` per prompt in prompt order, from
    the left-padded ``encoded`` prompts and the ``generated`` ids (and the sampler's log-probs of them, if any)."""
    response_mask = _response_mask(generated, tokenizer.eos_token_id)
    generated = torch.where(response_mask.bool(), generated, tokenizer.pad_token_id)
    prompt_mask = encoded["attention_mask"].repeat_interleave(n, dim=0)
    prompt_zeros = torch.zeros_like(prompt_mask, dtype=torch.float32)
    return RolloutBatch(
        input_ids=torch.cat([encoded["input_ids"].repeat_interleave(n, dim=0), generated], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        response_mask=torch.cat([prompt_zeros, response_mask], dim=1),
        group_ids=torch.arange(len(prompts), device=generated.device).repeat_interleave(n),
        prompts=[p for p in prompts for _ in range(n)],
        responses=tokenizer.batch_decode(generated, skip_special_tokens=True),
        answers=[a for a in answers for _ in range(n)] if answers is not None else [],
        rollout_logprobs=None if rollout_logprobs is None else torch.cat(
            [prompt_zeros, rollout_logprobs * response_mask], dim=1),
    )


def pack_response_rows(tokenizer: PreTrainedTokenizerBase, encoded: dict[str, Tensor],
                       rows: Iterable[tuple[list[int], list[float]]], prompts: list[str], n: int,
                       answers: list[str] | None) -> RolloutBatch:
    """:func:`pack_rollouts` of responses given row by row as (token ids, sampler log-probs) — an engine that samples
    elsewhere (vLLM, a rollout server) — right-padded into one tensor each."""
    rows = list(rows)
    width = max(1, max(len(tokens) for tokens, _ in rows))
    generated = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    sampler_logprobs = torch.zeros(generated.shape)
    for row, (tokens, logprobs) in enumerate(rows):
        generated[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        sampler_logprobs[row, :len(tokens)] = torch.tensor(logprobs)
    return pack_rollouts(tokenizer, encoded, generated, prompts, n, answers, sampler_logprobs)


def encode_pairs(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], responses: list[str], answers: list[str] | None = None,
    append_eos: bool = True,
) -> RolloutBatch:
    """Pack given (prompt, response) pairs into the same layout as :meth:`HFRolloutEngine.generate`.

    Used for expert solutions (offline flow pretraining) and for scoring existing responses.
    """
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    eos = [tokenizer.eos_token_id] if append_eos and tokenizer.eos_token_id is not None else []
    response_ids = [tokenizer(r, add_special_tokens=False)["input_ids"] + eos for r in responses]
    length = max(len(r) for r in response_ids)
    pad = tokenizer.pad_token_id
    generated = torch.tensor([r + [pad] * (length - len(r)) for r in response_ids], dtype=torch.long)
    response_mask = torch.tensor([[1.0] * len(r) + [0.0] * (length - len(r)) for r in response_ids])
    prompt_mask = encoded["attention_mask"]
    return RolloutBatch(
        input_ids=torch.cat([encoded["input_ids"], generated], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        response_mask=torch.cat([torch.zeros_like(prompt_mask, dtype=torch.float32), response_mask], dim=1),
        group_ids=torch.arange(len(prompts)),
        prompts=list(prompts),
        responses=list(responses),
        answers=list(answers) if answers is not None else [],
    )


def expert_latents(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, tap: LatentTap, prompts: list[str],
    solutions: list[str], device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Tapped latents (P×B×S×d) and response mask of expert (prompt, solution) pairs, without gradients."""
    expert = encode_pairs(tokenizer, prompts, solutions).to(device)
    return _tapped_latents(model, tap, expert), expert.response_mask


def _tapped_latents(model: torch.nn.Module, tap: LatentTap, batch: RolloutBatch) -> Tensor:
    """The decoder runs only up to the deepest tapped block (all of it under ZeRO-3, which gathers parameters
    in the order of whole forwards)."""
    return tap.capture(lambda: forward_hidden(model, batch), stop_early=not zero3_sharded(model.parameters()))


class ExpertLatentCache:
    """:func:`expert_latents` that encodes each (prompt, solution) pair once and keeps its latents on CPU: offline
    pretraining over several epochs with a frozen backbone would otherwise re-encode every pair each epoch. A
    batch comes back in :func:`encode_pairs`' layout (prompts right-aligned to the widest, responses after them;
    zeros on padding, which the flow loss masks). It holds P × d floats per token of every pair seen, so it suits
    small backbones and datasets, not a 7B policy's."""

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, tap: LatentTap, device: torch.device):
        self.model, self.tokenizer, self.tap, self.device = model, tokenizer, tap, device
        self.rows: dict[tuple[str, str], tuple[Tensor, int]] = {}  # pair → (P×L×d latents of its tokens, prompt length)

    def __call__(self, prompts: list[str], solutions: list[str]) -> tuple[Tensor, Tensor]:
        pairs = list(zip(prompts, solutions))
        missing = list(dict.fromkeys(pair for pair in pairs if pair not in self.rows))
        if missing:
            self._encode(missing)
        prompt_width = max(self.rows[pair][1] for pair in pairs)
        response_width = max(self.rows[pair][0].shape[1] - self.rows[pair][1] for pair in pairs)
        first = self.rows[pairs[0]][0]
        latents = first.new_zeros(first.shape[0], len(pairs), prompt_width + response_width, first.shape[2])
        response_mask = torch.zeros(len(pairs), prompt_width + response_width)
        for row, pair in enumerate(pairs):
            tokens, prompt_length = self.rows[pair]
            start = prompt_width - prompt_length
            latents[:, row, start:start + tokens.shape[1]] = tokens
            response_mask[row, prompt_width:prompt_width + tokens.shape[1] - prompt_length] = 1.0
        return latents.to(self.device), response_mask.to(self.device)

    def _encode(self, pairs: list[tuple[str, str]]) -> None:
        expert = encode_pairs(self.tokenizer, [p for p, _ in pairs], [s for _, s in pairs]).to(self.device)
        latents = _tapped_latents(self.model, self.tap, expert).cpu()
        prompt_width = int((expert.response_mask.sum(0) == 0).sum())  # encode_pairs: all prompts end at this column
        for row, pair in enumerate(pairs):
            real = expert.attention_mask[row].bool().cpu()
            self.rows[pair] = (latents[:, row, real].clone(), int(real[:prompt_width].sum()))
