"""Padding-free forwards: the real tokens of a :class:`~flowkit.batch.RolloutBatch`'s rows packed into one sequence.

A B×S batch (``[left padding][prompt][response][right padding]`` per row) spends the decoder's compute on every
padded position; long-tailed response lengths make that about half of it. Packed, the rows' real tokens run as one
1×T sequence (T = the real tokens), each row's positions restarting at 0, as verl, OpenRLHF and TRL pack. With no
attention mask, transformers keeps attention within each row from the restarts in ``position_ids``: flash-attention's
varlen kernels take them as ``cu_seqlens``; ``eager`` and ``flex_attention`` get a block-causal mask from the masking
utilities. ``sdpa`` runs row by row instead (:func:`row_by_row_sdpa`): its block-causal mask would cost T² per layer,
where the rows' own attention costs Σ length². The outputs go back to B×S (zeros on padding), so log-probs, values
and latents read them as before.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flowkit.llm.forward import position_ids
from flowkit.llm.sdpa import SDPA_IMPLEMENTATIONS

# Attention implementations whose transformers mask or kernel separates packed rows by their position ids.
PACKING_ATTENTION = (*SDPA_IMPLEMENTATIONS, "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
ROW_BY_ROW_SDPA = "flowkit_row_by_row_sdpa"


def row_by_row_sdpa(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    position_ids: Tensor, **kwargs) -> tuple[Tensor, None]:
    """transformers' ``sdpa`` attention over each packed row on its own (causal, no mask): a row starts where
    ``position_ids`` restarts at 0. Registered as ``flowkit_row_by_row_sdpa``; transformers builds no mask for it."""
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    lengths = [end - start for start, end in zip(starts, starts[1:] + [query.shape[2]])]
    rows = zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))
    return torch.cat([sdpa_attention_forward(module, *row, None, **kwargs)[0] for row in rows], dim=1), None


AttentionInterface.register(ROW_BY_ROW_SDPA, row_by_row_sdpa)


@contextmanager
def _packed_attention(model: torch.nn.Module):
    """``sdpa`` switched to :func:`row_by_row_sdpa` for one forward, where that is sound: no activation checkpointing
    (its recomputation in the backward would run outside the switch) and no sliding-window layer (a row would attend
    past its window); elsewhere transformers' block-causal mask."""
    config = model.config
    implementation = config._attn_implementation
    switch = implementation in SDPA_IMPLEMENTATIONS and not any(
        getattr(m, "gradient_checkpointing", False) or getattr(m, "sliding_window", None) for m in model.modules())
    if switch:
        config._attn_implementation = ROW_BY_ROW_SDPA
    try:
        yield
    finally:
        if switch:
            config._attn_implementation = implementation


def packs_rows(model: torch.nn.Module) -> bool:
    """Whether ``model``'s decoder keeps packed rows apart: an attention implementation of :data:`PACKING_ATTENTION`
    in a decoder whose module builds its mask with transformers' ``create_causal_mask`` (the utility that reads
    packed position ids). Other models (remote code with a mask of its own) run padded."""
    decoder = model.get_decoder()
    implementation = getattr(model.config, "_attn_implementation", None)
    return implementation in PACKING_ATTENTION and hasattr(sys.modules[type(decoder).__module__], "create_causal_mask")


@dataclass(frozen=True)
class PackedRows:
    """Where each packed token comes from: row ``rows[t]``, column ``cols[t]`` of a ``shape`` (B, S) batch, at
    position ``positions[t]`` (counted from the row's first real token, as during generation)."""

    rows: Tensor
    cols: Tensor
    positions: Tensor
    shape: tuple[int, int]

    @staticmethod
    def of(attention_mask: Tensor) -> PackedRows:
        """The real tokens of every row, row after row, each row's in column order."""
        rows, cols = attention_mask.bool().nonzero(as_tuple=True)
        return PackedRows(rows, cols, position_ids(attention_mask)[rows, cols], tuple(attention_mask.shape))

    @property
    def tokens(self) -> int:
        return len(self.rows)

    def forward_hidden(self, model: torch.nn.Module, input_ids: Tensor) -> Tensor:
        """The decoder's last hidden state over the packed rows of ``input_ids`` (B×S), back in B×S×d (zeros on
        padding; see :func:`flowkit.llm.forward.forward_hidden`). No KV cache: transformers reads packed position ids
        only without one."""
        with _packed_attention(model):
            hidden = model.get_decoder()(input_ids=input_ids[self.rows, self.cols][None],
                                         position_ids=self.positions[None], use_cache=False).last_hidden_state
        return self.unpack(hidden[0])

    def unpack(self, packed: Tensor) -> Tensor:
        """``packed`` (…×T×d, one entry per packed token) at its rows' places: …×B×S×d, zeros on padding
        (differentiable)."""
        index = self.rows * self.shape[1] + self.cols
        unpacked = packed.new_zeros((*packed.shape[:-2], self.shape[0] * self.shape[1], packed.shape[-1]))
        return unpacked.index_copy(-2, index, packed).unflatten(-2, self.shape)
