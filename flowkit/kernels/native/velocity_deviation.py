"""Fake tensors and autograd for the native RLFR ops ``torch.ops.flowkit.{interpolate_latents, velocity_deviation}``."""

from __future__ import annotations

import torch
from torch.library import register_autograd, register_fake


@register_fake("flowkit::interpolate_latents")
def _interpolate_latents_fake(x1, timesteps, seed, token_offset):
    num_layers, num_tokens, dim = x1.shape
    return x1.new_empty((num_layers * timesteps.shape[0] * num_tokens, dim))


@register_fake("flowkit::velocity_deviation")
def _velocity_deviation_fake(v, x1, timesteps, weights, seed, token_offset, mask):
    return v.new_empty((x1.shape[1],), dtype=torch.float64 if v.dtype == torch.float64 else torch.float32)


@register_fake("flowkit::velocity_deviation_backward")
def _velocity_deviation_backward_fake(grad_score, v, x1, timesteps, weights, seed, token_offset, mask):
    return torch.empty_like(v)


def save_for_deviation_backward(ctx, inputs, output):
    v, x1, timesteps, weights, seed, token_offset, mask = inputs
    ctx.save_for_backward(v, x1, timesteps, weights, mask)
    ctx.seed, ctx.token_offset = seed, token_offset


def _velocity_deviation_backward(ctx, grad_score):
    v, x1, timesteps, weights, mask = ctx.saved_tensors
    grad_v = torch.ops.flowkit.velocity_deviation_backward(grad_score, v, x1, timesteps, weights, ctx.seed,
                                                           ctx.token_offset, mask)
    return grad_v, None, None, None, None, None, None


register_autograd("flowkit::velocity_deviation", _velocity_deviation_backward, setup_context=save_for_deviation_backward)
