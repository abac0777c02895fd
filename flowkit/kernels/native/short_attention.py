"""Fake tensors for the native short-sequence attention ``torch.ops.flowkit.short_attention[_backward]`` (no
autograd: the autograd Function of :mod:`flowkit.kernels.short_attention` calls the backward op itself). A
``flowkit._C`` built before these ops lacks them; the reference then runs (:func:`flowkit.kernels.backends.native_has`)."""

from __future__ import annotations

import torch
from torch.library import register_fake


def _forward(query, key, value, mask, scale):
    rows, heads, queries, dim = query.shape
    return query.new_empty((rows, queries, heads, dim)), query.new_empty((rows, heads, queries))


if hasattr(torch.ops.flowkit, "short_attention"):
    register_fake("flowkit::short_attention", _forward)
    register_fake("flowkit::short_attention_backward",
                  lambda grad, query, key, value, out, lse, mask, scale: (
                      query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)))
