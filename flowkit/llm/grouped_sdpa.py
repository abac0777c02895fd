"""transformers' ``sdpa`` attention with a masked grouped-query attention in one SDPA call on CPU.

With an attention mask (left padding, a KV cache, shared prompts: every training forward flowkit runs padded),
transformers' ``sdpa`` copies each KV head once per query head of its group (``repeat_kv``) before SDPA, because CUDA's
fused kernels take no mask with ``enable_gqa`` and would fall back to the math kernel. PyTorch's flash kernel for CPU
takes both: passing the KV heads as they are with ``enable_gqa=True`` skips the copies forward and their sums
backward, with the same outputs and gradients to the bit (the test checks). On the bundled tiny policy's update this
is ~4% of the update phase. :func:`use_grouped_sdpa` (called by :func:`~flowkit.llm.backbone.load_backbone`)
switches a model from ``sdpa`` to this implementation, registered as ``flowkit_grouped_sdpa`` with transformers'
``sdpa`` mask; anything else — CUDA tensors, one query per row (decoding, where transformers packs the group into the
query instead), no mask, no grouping, a position bias — runs transformers' ``sdpa`` unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "flowkit_grouped_sdpa"
SDPA_IMPLEMENTATIONS = ("sdpa", GROUPED_SDPA)  # transformers' sdpa attention, as it computes


def grouped_sdpa(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                 **kwargs) -> tuple[Tensor, None]:
    """transformers' ``sdpa_attention_forward``, with the KV heads unrepeated under a mask on CPU."""
    grouped = (query.device.type == "cpu" and attention_mask is not None and query.shape[2] > 1
               and getattr(module, "num_key_value_groups", 1) > 1 and kwargs.get("position_bias") is None
               and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False))
    if not grouped:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def use_grouped_sdpa(model: torch.nn.Module) -> bool:
    """Switch ``model`` from ``sdpa`` to :func:`grouped_sdpa` (in its config, which is not saved with it); whether it
    switched."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(GROUPED_SDPA)
    return True
