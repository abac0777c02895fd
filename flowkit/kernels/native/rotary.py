"""Fake tensors for the native rotary embedding ``torch.ops.flowkit.rotary`` (inference only: no autograd). A
``flowkit._C`` built before this op lacks it; the reference then runs (:func:`flowkit.kernels.backends.native_has`)."""

from __future__ import annotations

import torch
from torch.library import register_fake

if hasattr(torch.ops.flowkit, "rotary"):
    register_fake("flowkit::rotary", lambda x, cos, sin: torch.empty_like(x))
