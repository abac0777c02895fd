"""The KV cache: a prompt's cache built once and shared by its samples (in decoding, and in the training forward of
a group's rows, :func:`forward_hidden_shared_prompts`), and layers that write into positions reserved up front
instead of concatenating per token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from flowkit.batch import RolloutBatch
from flowkit.llm.forward import position_ids


def forward_hidden_shared_prompts(model: torch.nn.Module, batch: RolloutBatch) -> Tensor | None:
    """:func:`forward_hidden` running each group's prompt once: the rows of a group (same ``group_ids``) share their
    prompt columns, so the decoder runs over them once per group, into a KV cache that every row of the group then
    reads and a last prompt column whose state every row takes (indexing both is differentiable: the rows' gradients
    add up in the shared prompt's). With 8 samples per prompt the prompt's forward and backward cost 1/8 of a
    row-by-row pass. B×S like :func:`forward_hidden`, with zeros in the prompt columns but the last and in the last
    column: only response tokens' log-probs and values are read, a token's from the column before it, so the last
    column's state predicts nothing and is not computed. None when no two rows share a prompt.

    Not for forwards whose hooks read every layer's output (a latent tap), nor for activation checkpointing or
    ZeRO-3, whose recomputation and parameter gathering assume one decoder pass per forward."""
    starts = batch.response_mask.argmax(-1)  # first response column of each row
    shared = int(starts.min()) if bool(batch.response_mask.any(-1).all()) else 0  # columns the group pass holds
    groups, inverse = torch.unique(batch.group_ids, return_inverse=True)
    if shared < 1 or len(groups) == batch.batch_size:
        return None
    rows = torch.arange(batch.batch_size, device=inverse.device)
    first = torch.full_like(groups, batch.batch_size).scatter_reduce(0, inverse, rows, "amin")  # one row per group
    ids, mask = batch.input_ids[:, :shared], batch.attention_mask[:, :shared]
    if not (torch.equal(ids, ids[first][inverse]) and torch.equal(mask, mask[first][inverse])):
        return None  # a group whose rows were encoded apart (other padding): no shared columns to rely on
    cache = DynamicCache(config=model.config)
    pieces = [_prefill(model, cache, ids[first], mask[first])[inverse, -1:]]
    cache.batch_select_indices(inverse)
    end = batch.input_ids.shape[1] - 1
    if end > shared:
        decoder = model.get_decoder()
        pieces.append(decoder(input_ids=batch.input_ids[:, shared:end], attention_mask=batch.attention_mask[:, :end],
                              position_ids=position_ids(batch.attention_mask)[:, shared:end], use_cache=True,
                              **{cache_argument(decoder): cache}).last_hidden_state)
    return torch.nn.functional.pad(torch.cat(pieces, dim=1), (0, 0, shared - 1, 1))


def cache_argument(decoder: torch.nn.Module) -> str:
    """The KV-cache keyword of this transformers version: ``cache`` (5.2x) or ``past_key_values`` (earlier)."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def prompt_cache(model: PreTrainedModel, encoded: dict[str, Tensor], n: int, shared: bool,
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


def recomputed_cache(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, capacity: int) -> DynamicCache:
    """A decoding cache (room for ``capacity`` positions) holding the KV of ``input_ids`` (left-padded rows, positioned
    as during generation) under the model's weights now, by one decoder pass: after a weight push mid-generation."""
    cache = _decoding_cache(model, capacity)
    _prefill(model, cache, input_ids, attention_mask)
    return cache


class ReservedLayer(DynamicLayer):
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
    cache.layers = [ReservedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _prefill(model: PreTrainedModel, cache: DynamicCache, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Fills ``cache`` with the KV of ``input_ids`` (left-padded rows, positioned as during generation) by one decoder
    pass; returns that pass's last hidden state."""
    decoder = model.get_decoder()
    return decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                   use_cache=True, **{cache_argument(decoder): cache}).last_hidden_state
