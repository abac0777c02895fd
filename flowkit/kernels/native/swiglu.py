"""Fake tensors for the native SwiGLU ops ``torch.ops.flowkit.swiglu[_backward]`` (no autograd: the autograd Function
of :mod:`flowkit.kernels.swiglu` calls the backward op itself, without the per-call Python of ``register_autograd``).
A ``flowkit._C`` built before these ops lacks them; the reference then runs
(:func:`flowkit.kernels.backends.native_has`)."""

from __future__ import annotations

import torch
from torch.library import register_fake

if hasattr(torch.ops.flowkit, "swiglu"):
    register_fake("flowkit::swiglu", lambda gate, up: torch.empty_like(gate))
    register_fake("flowkit::swiglu_backward", lambda grad, gate, up: (torch.empty_like(gate), torch.empty_like(up)))
