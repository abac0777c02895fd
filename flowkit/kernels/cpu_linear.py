"""A float32 linear layer on CPU through oneDNN: ``x @ W^T + b`` and its two gradient products.

PyTorch runs a float32 CPU matmul through its BLAS (MKL in the x86 wheels), and MKL takes its AVX-512 kernels on
Intel CPUs only: on an AMD one with AVX-512 it runs its AVX2 kernels. oneDNN, which PyTorch bundles for its bf16 CPU
path, dispatches on the instruction set instead and runs the same float32 products about 2× faster on Zen 5 (full
width AVX-512). On Zen 4 (AVX-512 as two 256-bit halves) AVX2 already reaches the core's peak: oneDNN is up to
~20% faster on large products and slower on small ones, where its call overhead and the Python backward count
(``benchmarks/bench_cpu_linear.py``). So a product takes oneDNN from :data:`ONEDNN_MIN_MACS` multiply-adds up:
2^21 on AMD family 1Ah (Zen 5) and later, 2^26 on any other CPU (Zen 4's crossover; the CPUs measured are those
two).

The oneDNN call is ``torch.ops.mkldnn._linear_pointwise`` (the op Inductor's CPU backend lowers linear layers to);
it has no autograd, so :class:`_OneDNNLinear` supplies the backward with the same op. Products differ from
``F.linear``'s in float32 summation order only. Anything else — CUDA tensors, other dtypes, CPU autocast, a torch
built without oneDNN, ``FLOWKIT_KERNELS=reference`` — runs ``F.linear`` (the reference) unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .backends import cpu_float32_path


def onednn_min_macs(cpuinfo: str) -> int:
    """The multiply-adds from which a product takes oneDNN on the CPU ``cpuinfo`` (``/proc/cpuinfo``'s text)
    describes: 2^21 on AMD family 1Ah+ (Zen 5: full-width AVX-512 that MKL leaves half used, so oneDNN is ~2× faster
    once a product outweighs the call), 2^26 elsewhere (Zen 4: same peak, oneDNN ahead only on large products)."""
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", cpuinfo, re.MULTILINE)
    family = re.search(r"^cpu family\s*:\s*(\d+)", cpuinfo, re.MULTILINE)
    full_width = bool(vendor and family) and vendor[1] == "AuthenticAMD" and int(family[1]) >= 0x1A
    return 1 << 21 if full_width else 1 << 26


def _cpuinfo() -> str:
    """The start of ``/proc/cpuinfo``: the first core's vendor and family (the whole file is ~1 KB per core)."""
    try:
        with Path("/proc/cpuinfo").open() as info:
            return info.read(4096)
    except OSError:  # not Linux
        return ""


ONEDNN_MIN_MACS = onednn_min_macs(_cpuinfo())  # this machine's
_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def _onednn_product(x: Tensor, weight: Tensor) -> bool:
    """Whether ``x @ weight^T`` (x: (..., K), weight: (N, K)) goes through oneDNN."""
    return (_ONEDNN_LINEAR is not None and weight.dtype == torch.float32
            and x.numel() * weight.shape[0] >= ONEDNN_MIN_MACS and cpu_float32_path(x))


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight^T + bias`` for a 2-D ``x`` by oneDNN (no activation fused)."""
    return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")


def _product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight^T + bias`` for a 2-D ``x``, through oneDNN when :func:`_onednn_product` says so."""
    return _onednn(x, weight, bias) if _onednn_product(x, weight) else torch.nn.functional.linear(x, weight, bias)


def grad_input(grad_output: Tensor, weight: Tensor) -> Tensor:
    """``grad_output @ weight`` (M, N) × (N, K): the input's gradient of a linear layer."""
    return _product(grad_output, weight.t())


def grad_weight(grad_output: Tensor, x: Tensor, scratch: Tensor | None = None) -> Tensor:
    """``grad_output^T @ x`` (M, N)ᵀ × (M, K): the weight's gradient of a linear layer. oneDNN takes a row-major
    input only, so it multiplies a transposed copy of the narrower operand: of ``grad_output`` when N ≤ K, else of
    ``x``, computing ``(x^T @ grad_output)^T`` and returning it as an (N, K) view of a (K, N) tensor (an LM head's
    N = 152k vocabulary against K = 4k hidden: M·K floats copied instead of M·N). ``scratch`` (a flat tensor of at
    least M·min(N, K) elements of its dtype) holds that copy instead of a fresh allocation, for a caller that repeats
    the product."""
    if not _onednn_product(grad_output.t(), x.t()):
        return torch.nn.functional.linear(grad_output.t(), x.t())
    if grad_output.shape[1] > x.shape[1]:
        return _onednn_transposed_product(x, grad_output, scratch).t()
    return _onednn_transposed_product(grad_output, x, scratch)


def _onednn_transposed_product(a: Tensor, b: Tensor, scratch: Tensor | None) -> Tensor:
    """``a^T @ b`` by oneDNN, ``a^T`` copied row-major (into ``scratch`` when given) and ``b`` made dense (see
    :meth:`_OneDNNLinear.backward`)."""
    transposed = a.t().contiguous() if scratch is None else scratch[:a.numel()].view(a.t().shape).copy_(a.t())
    return _onednn(transposed, b.contiguous().t(), None)


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        want_x, want_weight, want_bias = ctx.needs_input_grad
        grad = grad.contiguous()  # a sum's gradient is broadcast (stride 0): oneDNN would read it ~300× slower
        return (grad_input(grad, weight) if want_x else None,
                grad_weight(grad, x) if want_weight else None,
                grad.sum(0) if want_bias and ctx.has_bias else None)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of any leading shape, through oneDNN where it is faster (module
    docstring), differentiable in all three."""
    if not _onednn_product(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    differentiable = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and differentiable:
        out = _OneDNNLinear.apply(rows, weight, bias)
    else:
        out = _onednn(rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class OneDNNLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear`: same parameters, state dict and hooks."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` into a :class:`OneDNNLinear` in place (its class only: the same
    module objects, parameters and hooks); returns how many. A no-op in a torch built without oneDNN."""
    if _ONEDNN_LINEAR is None:
        return 0
    swapped = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = OneDNNLinear
            swapped += 1
    return swapped
