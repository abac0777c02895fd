"""Fake tensors for the native RMSNorm ops ``torch.ops.flowkit.rms_norm[_backward]`` (no autograd: the autograd
Function of :mod:`flowkit.kernels.rms_norm` calls the backward op itself, without the per-call Python of
``register_autograd``). A ``flowkit._C`` built before these ops lacks them; the reference then runs
(:func:`flowkit.kernels.backends.native_has`)."""

from __future__ import annotations

import torch
from torch.library import register_fake

if hasattr(torch.ops.flowkit, "rms_norm"):
    register_fake("flowkit::rms_norm", lambda x, weight, eps: (torch.empty_like(x), x.new_empty(x.shape[:-1])))
    register_fake("flowkit::rms_norm_backward",
                  lambda grad, x, weight, inverse_rms: (torch.empty_like(x), torch.empty_like(weight)))
