"""Fake tensor for the native decoding attention ``torch.ops.flowkit.decode_attention`` (inference only: no
autograd). A ``flowkit._C`` built before the op lacks it; the reference then runs
(:func:`flowkit.kernels.backends.native_has`)."""

from __future__ import annotations

import torch
from torch.library import register_fake


def _decode_attention_fake(query, keys, values, mask, scale):
    return query.new_empty(query.shape)


if hasattr(torch.ops.flowkit, "decode_attention"):
    register_fake("flowkit::decode_attention", _decode_attention_fake)
