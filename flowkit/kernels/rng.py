"""Counter-based Gaussian noise shared by every kernel implementation (reference, C++, CUDA, Triton).

The fused RLFR ops never store the noise ε: the prologue and the epilogue regenerate it from ``(seed, index)``.
So every implementation must compute bit-identical uniforms; this module is the specification.

Element with linear index ``i`` of a noise tensor is a pure function of ``(seed, c = offset + i)``:

1. ``mix(x)`` is the 32-bit "lowbias32" integer hash (C. Wellons):
   ``x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16`` (all mod 2**32).
2. Two stream keys from the seed (taken mod 2**32): ``k_s = mix(seed + s * 0x9E3779B9)`` for ``s = 0, 1``.
3. Two 32-bit draws: ``b_s = mix(mix(c_lo ^ k_s) ^ c_hi)`` with ``c_lo, c_hi`` the low / high 32 bits of ``c``.
4. Uniforms with 24 bits (exact in float32): ``u1 = ((b_0 >> 8) + 1) / 2**24`` in (0, 1],
   ``u2 = (b_1 >> 8) / 2**24`` in [0, 1).
5. Box–Muller, in float32: ``ε = sqrt(-2 ln u1) · cos(2π u2)``.

Integer steps are exact everywhere; only the float32 ``log``/``sqrt``/``cos`` differ in the last ulps between
math libraries, so implementations agree to ~1e-6 absolute.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B
STREAM_STEP = 0x9E3779B9
TWO_PI = 6.283185307179586


def mix32(x):
    """lowbias32 on values in [0, 2**32) held in int64 tensors or Python ints (products wrap, low 32 bits kept)."""
    x = x ^ (x >> 16)
    x = (x * MIX_MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_MUL2) & MASK32
    return x ^ (x >> 16)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` in place on an int64 tensor (half the temporaries: the noise is regenerated on every flow step)."""
    x ^= x >> 16
    x.mul_(MIX_MUL1).bitwise_and_(MASK32)
    x ^= x >> 15
    x.mul_(MIX_MUL2).bitwise_and_(MASK32)
    x ^= x >> 16
    return x


def stream_keys(seed: int) -> tuple[int, int]:
    """The two per-seed keys ``k_0, k_1`` (plain ints; kernels receive them as 32-bit scalars)."""
    seed = int(seed) & MASK32
    return mix32(seed), mix32((seed + STREAM_STEP) & MASK32)


# Counters per pass of :func:`flow_noise`: its int64 temporaries stay at a few × 8 MiB whatever the tensor's size.
NOISE_BLOCK = 1 << 20


def flow_noise(shape, seed: int, offset: int = 0, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal noise whose element ``i`` (row-major) depends only on ``(seed, offset + i)``.

    Same ``seed`` and ``offset`` give the same tensor on any device and in every kernel implementation;
    ``flow_noise(shape, seed, offset=k)`` equals ``flow_noise(bigger, seed).flatten()[k:k + numel]``. Generated
    :data:`NOISE_BLOCK` counters at a time, so only the float32 result scales with ``shape``.
    """
    shape = tuple(shape)
    numel = 1
    for size in shape:
        numel *= int(size)
    keys = stream_keys(seed)
    noise = torch.empty(numel, device=device, dtype=torch.float32)
    for start in range(0, numel, NOISE_BLOCK):
        count = min(NOISE_BLOCK, numel - start)
        noise[start:start + count] = _noise_block(int(offset) + start, count, keys, noise.device)
    return noise.reshape(shape).to(dtype)


def _noise_block(first: int, count: int, keys: tuple[int, int], device: torch.device) -> torch.Tensor:
    """The noise at counters ``first … first + count − 1`` (steps 3–5 of the module docstring)."""
    k0, k1 = keys
    counter = torch.arange(first, first + count, device=device, dtype=torch.int64)
    if first + count <= 2**32:  # c_hi = 0 and c_lo = c: skip the no-op mask and XOR
        b0, b1 = _mix32_(_mix32_(counter ^ k0)), _mix32_(_mix32_(counter ^ k1))
    else:
        c_lo, c_hi = counter & MASK32, counter >> 32
        b0, b1 = _mix32_(_mix32_(c_lo ^ k0) ^ c_hi), _mix32_(_mix32_(c_lo ^ k1) ^ c_hi)
    u1 = ((b0 >> 8) + 1).to(torch.float32).mul_(1.0 / 16777216.0)
    u2 = (b1 >> 8).to(torch.float32).mul_(1.0 / 16777216.0)
    return u1.log_().mul_(-2.0).sqrt_().mul_(u2.mul_(TWO_PI).cos_())
