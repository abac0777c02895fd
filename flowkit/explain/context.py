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
from transformers import PreTrainedModel

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
    ``hidden`` [B, N, d] final hidden states (for the attention-free ablation), ``lengths`` [B]."""

    keys: Tensor
    values: Tensor
    hidden: Tensor
    lengths: Tensor
    last_layer: LastLayer

    def select(self, index: Tensor) -> ContextEncoding:
        return ContextEncoding(self.keys[index], self.values[index], self.hidden[index], self.lengths[index],
                               self.last_layer)


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
    if not any(hasattr(p, "ds_id") for p in params):
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


@torch.no_grad()
def encode_context(backbone: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor) -> ContextEncoding:
    """One backbone forward over right-padded ``input_ids`` [B, N]; nothing here carries a gradient.

    With a peft model the adapters are disabled: the flow reads the frozen base LLM.
    """
    adapters_off = backbone.disable_adapter() if hasattr(backbone, "disable_adapter") else nullcontext()
    with adapters_off:
        out = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, output_hidden_states=True)
    cache = out.past_key_values
    return ContextEncoding(
        keys=cache.layers[-1].keys, values=cache.layers[-1].values, hidden=out.hidden_states[-1],
        lengths=attention_mask.sum(-1), last_layer=last_layer(backbone),
    )

