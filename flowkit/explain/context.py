"""One frozen-backbone pass over (prompt + explanation): the last layer's cached K/V, its hidden states,
and the last layer's own weights, everything the flow φ reads (seed 000 §3.1 "Cross-Attention", App. C).

Because the backbone is causal, the K/V of any prefix [0, n) equal the first n entries of the full
sequence's K/V; the flow restricts each evaluation to its prefix with ``prefix_lengths``, so the K
sentence prefixes of an explanation share this one pass.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed import ReduceOp
from transformers import PreTrainedModel

from flowkit.distributed import all_reduce_int, zero3_sharded
from flowkit.llm.backbone import decoder_layers


@dataclass
class LastLayer:
    """The frozen last decoder layer's attention weights (base weights when LoRA wraps them)."""

    input_layernorm: nn.Module
    q_weight: Tensor
    k_weight: Tensor
    v_weight: Tensor
    q_bias: Tensor | None
    k_bias: Tensor | None
    v_bias: Tensor | None
    o_proj: nn.Module
    inv_freq: Tensor
    attention_scaling: float
    num_heads: int
    num_kv_heads: int


@dataclass
class ContextEncoding:
    """Per-row context read by the flow: ``keys``/``values`` [B, Hkv, N, dh] (RoPE'd, as in HF's cache),
    ``hidden`` [B, N, d] final hidden states (only the attention-free ablation reads them; ``None`` when
    not kept), ``lengths`` [B]."""

    keys: Tensor
    values: Tensor
    hidden: Tensor | None
    lengths: Tensor
    last_layer: LastLayer

    def select(self, index: Tensor) -> ContextEncoding:
        hidden = None if self.hidden is None else self.hidden[index]
        return ContextEncoding(self.keys[index], self.values[index], hidden, self.lengths[index], self.last_layer)


def _base_linear(module: nn.Module) -> nn.Module:
    """The frozen linear under a peft LoRA wrapper (or the module itself)."""
    return getattr(module, "base_layer", module)


def _whole(*params: Tensor | None) -> tuple[Tensor | None, ...]:
    """``params`` as they are, or, under DeepSpeed ZeRO-3, whole copies of them.

    ZeRO-3 shards parameters (marking them with ``ds_id``): a rank's ``.data`` is empty unless the parameter
    is gathered. The flow reads these frozen weights as plain tensors in its own forward and backward, so
    the sharded ones are gathered here (a collective: every rank encodes together) and copied out. Inside
    the engine's forward, reading a parameter has already gathered it for that forward: it is only copied.
    """
    if not zero3_sharded(params):
        return params
    import deepspeed  # sharded parameters mean DeepSpeed is installed
    from deepspeed.runtime.zero import ZeroParamStatus

    sharded = [p for p in params if p is not None and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    with deepspeed.zero.GatheredParameters(sharded, modifier_rank=None):
        return tuple(None if p is None else p.detach().clone() for p in params)


def last_layer(backbone: PreTrainedModel) -> LastLayer:
    layer = decoder_layers(backbone)[-1]
    attn = layer.self_attn
    q, k, v = (_base_linear(attn.q_proj), _base_linear(attn.k_proj), _base_linear(attn.v_proj))
    q_weight, k_weight, v_weight, q_bias, k_bias, v_bias = _whole(q.weight, k.weight, v.weight, q.bias, k.bias,
                                                                  v.bias)
    config = backbone.config
    base = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone
    rotary = getattr(base, base.base_model_prefix).rotary_emb
    return LastLayer(
        input_layernorm=layer.input_layernorm, q_weight=q_weight, k_weight=k_weight, v_weight=v_weight,
        q_bias=q_bias, k_bias=k_bias, v_bias=v_bias, o_proj=_base_linear(attn.o_proj), inv_freq=rotary.inv_freq,
        attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
    )


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class _LastLayerKV:
    """Forward hooks on the last decoder layer that keep only its RoPE'd K/V ``[B, Hkv, N, dh]``.

    The K/V are the last layer's ``k_proj``/``v_proj`` outputs with the layer's own rotary (cos, sin), the
    same tensors HF's cache would hold for that layer, without a cache for the other layers.
    """

    def __init__(self, backbone: PreTrainedModel):
        attn = decoder_layers(backbone)[-1].self_attn
        config = backbone.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self._rotary: tuple[Tensor, Tensor] | None = None
        self._handles = [
            attn.register_forward_pre_hook(self._read_rotary, with_kwargs=True),
            attn.k_proj.register_forward_hook(lambda _m, _i, out: setattr(self, "keys", self._heads(out))),
            attn.v_proj.register_forward_hook(lambda _m, _i, out: setattr(self, "values", self._heads(out))),
        ]

    def _read_rotary(self, _module, args, kwargs) -> None:
        self._rotary = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]

    def _heads(self, projected: Tensor) -> Tensor:
        batch, length, _ = projected.shape
        return projected.view(batch, length, -1, self.head_dim).transpose(1, 2)

    def rotated_keys(self) -> Tensor:
        cos, sin = (x.unsqueeze(1) for x in self._rotary)
        return self.keys * cos + _rotate_half(self.keys) * sin

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _decoder(backbone: PreTrainedModel) -> nn.Module:
    """The decoder stack without the LM head: running it never materialises the [B, N, |V|] logits."""
    base = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone
    return getattr(base, base.base_model_prefix)


@torch.no_grad()
def encode_context(backbone: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor,
                   micro_batch_size: int = 8, keep_hidden: bool = True) -> ContextEncoding:
    """The flow's context of right-padded ``input_ids`` [B, N], ``micro_batch_size`` rows per backbone pass.

    Memory-bounded: each pass runs the decoder stack alone (no LM head, so no logits), without a KV cache
    and without all-layer hidden states; hooks keep only the last layer's K/V, and the final hidden states
    are kept only with ``keep_hidden`` (the attention-free ablation reads them; ``hidden`` is ``None``
    otherwise). Besides the returned tensors, the peak is one micro-batch's activations. With a peft model
    the adapters are disabled: the flow reads the frozen base LLM. Nothing here carries a gradient.
    """
    adapters_off = backbone.disable_adapter() if hasattr(backbone, "disable_adapter") else nullcontext()
    decoder, capture = _decoder(backbone), _LastLayerKV(backbone)
    batch, length = input_ids.shape
    starts = list(range(0, batch, micro_batch_size))
    # Under ZeRO-3 every forward is a collective: all ranks run as many passes as the rank with the most.
    if zero3_sharded(backbone.parameters()):
        starts += [None] * (all_reduce_int(len(starts), ReduceOp.MAX) - len(starts))
    keys = values = hidden = None
    try:
        with adapters_off:
            for start in starts:
                rows = slice(0, 1) if start is None else slice(start, start + micro_batch_size)
                width = max(int(attention_mask[rows].sum(-1).max()), 1)  # right padding: trim to the longest row
                out = decoder(input_ids=input_ids[rows, :width], attention_mask=attention_mask[rows, :width],
                              use_cache=False)
                if start is None:  # a pass only to keep the collectives in step
                    continue
                k, v = capture.rotated_keys(), capture.values
                if keys is None:
                    keys = k.new_zeros(batch, k.shape[1], length, k.shape[-1])
                    values = torch.zeros_like(keys)
                    hidden = out.last_hidden_state.new_zeros(batch, length, out.last_hidden_state.shape[-1]) \
                        if keep_hidden else None
                keys[rows, :, :width], values[rows, :, :width] = k, v
                if keep_hidden:
                    hidden[rows, :width] = out.last_hidden_state
    finally:
        capture.remove()
    return ContextEncoding(keys=keys, values=values, hidden=hidden, lengths=attention_mask.sum(-1),
                           last_layer=last_layer(backbone))
