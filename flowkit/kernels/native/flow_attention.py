"""Fake tensors and autograd for the native flow-token attention core ``torch.ops.flowkit.flow_attention``."""

from __future__ import annotations

import torch
from torch.library import register_autograd, register_fake


@register_fake("flowkit::flow_attention")
def _flow_attention_fake(q, flow_k, flow_v, context_k, context_v, prefix_lengths):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=lse_dtype)


@register_fake("flowkit::flow_attention_backward")
def _flow_attention_backward_fake(grad_out, q, flow_k, flow_v, context_k, context_v, prefix_lengths, out, lse):
    return torch.empty_like(q), torch.empty_like(flow_k), torch.empty_like(flow_v)


def save_for_attention_backward(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _flow_attention_backward(ctx, grad_out, grad_lse):
    q, flow_k, flow_v, context_k, context_v, prefix_lengths, out, lse = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.ops.flowkit.flow_attention_backward(
        grad_out, q, flow_k, flow_v, context_k, context_v, prefix_lengths, out, lse)
    return grad_q, grad_k, grad_v, None, None, None


register_autograd("flowkit::flow_attention", _flow_attention_backward, setup_context=save_for_attention_backward)
