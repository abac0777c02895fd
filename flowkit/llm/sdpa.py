"""flowkit's ``sdpa`` attention: transformers' ``sdpa``, with masked attention on CPU through flowkit's kernel.

Every padded training forward flowkit runs (left padding, responses reading a group's cached prompt) calls attention
with a mask. There transformers' ``sdpa`` first copies each KV head once per query head of its group
(``repeat_kv``: CUDA's fused kernels take no mask with grouped heads) and PyTorch's flash kernel for CPU then tiles
~30 queries and ~45 keys per row into blocks sized for long sequences. :func:`flowkit_sdpa` hands such calls on CPU
to :func:`~flowkit.kernels.short_attention.short_attention` instead: the KV heads as they are, and a native kernel
for short sequences whose reference is SDPA with ``enable_gqa`` (transformers' ``sdpa`` to the bit: the test
checks). On the bundled tiny policy the update phase is ~4% faster from the copies alone and ~5% more from the
kernel. :func:`use_flowkit_sdpa` (called by :func:`~flowkit.llm.backbone.load_backbone`) switches a model from
``sdpa`` to it, registered as ``flowkit_sdpa`` with transformers' ``sdpa`` mask; everything else — CUDA tensors, one
query per row (decoding, where transformers packs the group into the query), no mask where attention is not
causal, dropout, a float mask, a position bias — runs transformers' ``sdpa`` unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flowkit.kernels.short_attention import short_attention

FLOWKIT_SDPA = "flowkit_sdpa"
SDPA_IMPLEMENTATIONS = ("sdpa", FLOWKIT_SDPA)  # transformers' sdpa attention, as it computes


def flowkit_sdpa(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                 **kwargs) -> tuple[Tensor, None]:
    """transformers' ``sdpa_attention_forward``, through :func:`short_attention` for a call on CPU with a bool mask or
    a causal one (an unpadded pass without a cache: the same kernel as a padded one, so a row's outputs do not depend
    on whether another row of its batch is padded)."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    mask = attention_mask
    if mask is None and causal and query.shape[2] == key.shape[2]:
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
        mask = mask.expand(query.shape[0], 1, *mask.shape)
    kernel = (query.device.type == "cpu" and mask is not None and mask.dtype == torch.bool and mask.shape[1] == 1
              and query.shape[2] > 1 and dropout == 0.0 and kwargs.get("position_bias") is None
              and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False))
    if not kernel:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return short_attention(query, key, value, mask, scale), None


AttentionInterface.register(FLOWKIT_SDPA, flowkit_sdpa)
AttentionMaskInterface.register(FLOWKIT_SDPA, sdpa_mask)


def use_flowkit_sdpa(model: torch.nn.Module) -> bool:
    """Switch ``model`` from ``sdpa`` to :func:`flowkit_sdpa` (in its config, which is not saved with it); whether
    it switched."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(FLOWKIT_SDPA)
    return True
