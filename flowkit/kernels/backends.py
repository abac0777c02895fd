"""Which implementation runs an op: native CUDA → Triton (CUDA tensors) → native CPU (``flowkit._C``) → reference.

``FLOWKIT_KERNELS=reference|triton|native`` forces one; a forced or expected build that is missing falls back to
the automatic choice with one warning per message. Triton runs on CPU tensors only when forced, which is how the
tests drive it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

ENV_VAR = "FLOWKIT_KERNELS"
CHOICES = ("reference", "triton", "native")
_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@functools.cache
def native_loaded() -> bool:
    """True when ``flowkit._C`` imports (it registers the ``torch.ops.flowkit`` kernels); also registers fakes/autograd."""
    try:
        from . import native
    except ImportError:
        return False
    return native.LOADED


@functools.cache  # asked on every call of an op; what flowkit._C registered does not change once loaded
def native_has(device_type: str, op: str = "velocity_deviation") -> bool:
    """True when ``flowkit._C`` was built with a kernel of ``op`` for ``device_type`` ("cpu" or "cuda")."""
    if not native_loaded():
        return False
    key = "CUDA" if device_type == "cuda" else "CPU"
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"flowkit::{op}", key)
    except RuntimeError:  # a flowkit._C built before the op existed
        return False


@functools.cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available_backends(device_type: str | None = None) -> list[str]:
    """Backends usable for tensors on ``device_type`` (default: CUDA if available, else CPU), in dispatch order."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    found = []
    if device_type == "cuda" and native_has("cuda"):
        found.append("native")
    if triton_importable() and (device_type == "cuda" or triton_interpreting()):
        found.append("triton")
    if device_type == "cpu" and native_has("cpu"):
        found.append("native")
    found.append("reference")
    return found


def forced_backend() -> str:
    """The backend ``FLOWKIT_KERNELS`` forces, or "" when it forces none."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced and forced not in CHOICES:
        raise ValueError(f"{ENV_VAR}={forced!r}; expected one of {CHOICES}")
    return forced


def select_backend(device: torch.device) -> str:
    """The backend an op on ``device`` runs with (see module docstring)."""
    forced = forced_backend()
    available = available_backends(device.type)
    if forced:
        if forced in available:
            return forced
        warn_once(f"{ENV_VAR}={forced} is not available for {device.type} tensors; using {available[0]}")
        return available[0]
    if device.type == "cuda":
        if "native" not in available:
            warn_once("flowkit._C has no CUDA kernels (build with a CUDA toolkit and a CUDA torch); using "
                      + ("Triton" if "triton" in available else "the reference ops"))
        return available[0]
    if "native" not in available:
        warn_once("flowkit._C is not built (pip install -e . builds it); using the PyTorch reference ops")
    return "native" if "native" in available else "reference"


def cpu_float32_path(tensor: torch.Tensor) -> bool:
    """Whether one of flowkit's own float32 CPU paths may take ``tensor``: a float32 CPU tensor outside CPU autocast
    (where the reference's ops take autocast's dtypes), and ``FLOWKIT_KERNELS`` not forcing the references."""
    return (tensor.device.type == "cpu" and tensor.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
            and forced_backend() != "reference")


def runs_native_cpu_float32(tensor: torch.Tensor, op: str) -> bool:
    """Whether a CPU-only native ``op`` (no Triton or CUDA kernel) runs for ``tensor``: :func:`cpu_float32_path`, the
    native backend selected and ``flowkit._C`` built with the op."""
    return cpu_float32_path(tensor) and select_backend(tensor.device) == "native" and native_has("cpu", op)
