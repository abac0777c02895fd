"""Rollout generation and (prompt, response) encoding into :class:`RolloutBatch` layout.

Layout: each row is ``[left padding][prompt][response][right padding]`` — the layout HF ``generate``
produces. Positions are derived from the attention mask (see :func:`position_ids`), so a forward over a
batch gives the same logits as the generation did.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Iterator

import torch
from torch import Tensor
from torch.distributed import ReduceOp
from transformers import (
    DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase,
)

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


class _NonFiniteGuard(LogitsProcessor):
    """Notes non-finite next-token scores (NaN / inf weights) and replaces them by finite ones, so sampling
    does not crash inside ``generate`` and the caller can apply its own non-finite policy afterwards."""

    def __init__(self):
        self.seen = False

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if torch.isfinite(scores).all():
            return scores
        self.seen = True
        return torch.nan_to_num(scores, nan=0.0, posinf=torch.finfo(scores.dtype).max, neginf=torch.finfo(scores.dtype).min)


@contextmanager
def _sampling_as_requested(model: PreTrainedModel) -> Iterator[None]:
    """``generate`` fills every option it is not given from the model's ``generation_config`` (instruct models ship
    e.g. top_k 20 and repetition_penalty 1.05), then from global defaults (top_k 50). Each reshapes the sampling
    distribution away from the policy's tempered softmax, so the rollouts would be off-policy for the loss, which
    scores them under the full softmax. While generating, the model's config carries only its special tokens."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT reads the base model's
    saved = base.generation_config
    base.generation_config = GenerationConfig(bos_token_id=saved.bos_token_id, eos_token_id=saved.eos_token_id,
                                              pad_token_id=saved.pad_token_id)
    try:
        yield
    finally:
        base.generation_config = saved


def _cache_argument(decoder: torch.nn.Module) -> str:
    """The KV-cache keyword of this transformers version: ``cache`` (5.2x) or ``past_key_values`` (earlier)."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def _shared_prompt_prefill(model: PreTrainedModel, encoded: dict[str, Tensor], n: int) -> dict[str, Any]:
    """``generate`` inputs for ``n`` samples per prompt whose prompt is encoded once, not ``n`` times: the decoder
    runs over every prompt token but the last into a KV cache, which is repeated ``n`` times per row; ``generate``
    then starts from the last prompt token. The samples are those of ``num_return_sequences = n`` (same logits, same
    sampler draws), at 1/n of the prompt's compute."""
    input_ids, attention_mask = encoded["input_ids"], encoded["attention_mask"]
    decoder = model.get_decoder()
    name = _cache_argument(decoder)
    cache = DynamicCache(config=model.config)
    decoder(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
            position_ids=position_ids(attention_mask[:, :-1]), use_cache=True, **{name: cache})
    cache.batch_repeat_interleave(n)
    return {"input_ids": input_ids.repeat_interleave(n, dim=0), "attention_mask": attention_mask.repeat_interleave(n, dim=0),
            name: cache}


class RolloutEngine:
    """Samples ``n`` responses per prompt with HF ``generate`` and packs them into a :class:`RolloutBatch`.

    Args:
        rollout_batch_size: sequences (prompts × n) per ``generate`` call, which bounds the KV cache; a multiple
            of ``n`` (whole groups per call). None: all prompts in one call.
        whole_weights: a context in which the model's weights are whole and its forwards run no collective
            (:func:`flowkit.strategies.whole_weights_for_generation` under ZeRO-3); generation then runs inside it,
            each rank at its own pace. None: under ZeRO-3 each decoding step gathers the weights, and ranks step in
            lockstep (``synced_gpus``).

    After each :meth:`generate`, :attr:`saw_nonfinite_logits` says whether any next-token score was NaN or
    inf (the sequences are then garbage; the policy module skips or fails the step).
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
        sampling = ({"do_sample": True, "temperature": temperature, "top_p": self.top_p, "top_k": 0} if temperature > 0
                    else {"do_sample": False})
        was_training = self.model.training
        self.model.eval()
        guard = _NonFiniteGuard()
        synced = _zero3_partitioned(self.model) and self.whole_weights is None
        shared = n > 1 and encoded["input_ids"].shape[1] > 1
        if synced:  # the prefill is a forward, a collective under ZeRO-3: every rank runs it or none
            shared = bool(all_reduce_int(int(shared), ReduceOp.MIN))
        with (self.whole_weights or nullcontext)(), _sampling_as_requested(self.model):
            output = self.model.generate(
                **(_shared_prompt_prefill(self.model, encoded, n) if shared else encoded),
                max_new_tokens=self.max_new_tokens,
                num_return_sequences=1 if shared else n,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
                synced_gpus=synced,
                logits_processor=LogitsProcessorList([guard]),
                **sampling,
            )
        self.model.train(was_training)
        self.saw_nonfinite_logits |= guard.seen
        prompt_len = encoded["input_ids"].shape[1]
        return pack_rollouts(self.tokenizer, encoded, output[:, prompt_len:], prompts, n, answers)


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


def encode_pairs(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], responses: list[str], answers: list[str] | None = None,
    append_eos: bool = True,
) -> RolloutBatch:
    """Pack given (prompt, response) pairs into the same layout as :meth:`RolloutEngine.generate`.

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
