"""flowkit's ``sdpa`` attention: transformers' ``sdpa``, without copies of the KV heads for short masked calls on CPU.

Every padded training forward flowkit runs (left padding, responses reading a group's cached prompt) calls attention
with a mask, and there transformers' ``sdpa`` copies each KV head once per query head of its group (``repeat_kv``)
before SDPA, because CUDA's fused kernels take no mask with grouped heads. PyTorch's flash kernel for CPU takes both.
With at most :data:`SHORT_KEYS` keys, where the copies weigh most against the attention itself, :func:`flowkit_sdpa`
passes the KV heads as they are with ``enable_gqa=True``: the outputs are transformers' to the bit, the key and value
gradients to float32 rounding (the group's sum in another order). On the bundled tiny policy (~45 keys) the update
phase is ~4% faster; at 140–270 keys the grouped call measured no faster than the copies (up to ~10% slower at head
dimension 64), so longer calls keep transformers' path. :func:`use_flowkit_sdpa` (called by
:func:`~flowkit.llm.backbone.load_backbone`) switches a model from ``sdpa`` to it, registered as ``flowkit_sdpa``
with transformers' ``sdpa`` mask; everything else — CUDA tensors, other dtypes than float32 and CPU autocast (as for
flowkit's native CPU kernels: a bf16 run keeps transformers' numerics), one query per row (decoding, where
transformers packs the group into the query), no mask, no grouping, a position bias, ``FLOWKIT_KERNELS=reference``
— runs transformers' ``sdpa`` unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flowkit.kernels.backends import cpu_float32_path

FLOWKIT_SDPA = "flowkit_sdpa"
SDPA_IMPLEMENTATIONS = ("sdpa", FLOWKIT_SDPA)  # transformers' sdpa attention, as it computes
SHORT_KEYS = 64  # the longest key sequence that takes the grouped call


def flowkit_sdpa(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                 **kwargs) -> tuple[Tensor, None]:
    """transformers' ``sdpa_attention_forward``, with the KV heads unrepeated for a short masked call on CPU."""
    grouped = (cpu_float32_path(query) and attention_mask is not None and query.shape[2] > 1
               and key.shape[2] <= SHORT_KEYS and getattr(module, "num_key_value_groups", 1) > 1
               and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
               and not kwargs.get("output_attentions", False))
    if not grouped:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FLOWKIT_SDPA, flowkit_sdpa)
AttentionMaskInterface.register(FLOWKIT_SDPA, sdpa_mask)


def use_flowkit_sdpa(model: torch.nn.Module) -> bool:
    """Switch ``model`` from ``sdpa`` to :func:`flowkit_sdpa` (in its config, which is not saved with it); whether
    it switched."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(FLOWKIT_SDPA)
    return True
