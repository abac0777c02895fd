"""Triton device function for :mod:`flowkit.kernels.rng` (same integer hash, Box–Muller with Triton's libm)."""

import triton
import triton.language as tl


@triton.jit
def mix32(x):
    """lowbias32 on uint32 (wrapping multiplies)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def noise_at(counter, k0, k1):
    """Standard normal for int64 ``counter`` tensors under stream keys ``k0, k1`` (uint32 bits in int32 scalars)."""
    k0 = k0.to(tl.uint32, bitcast=True)
    k1 = k1.to(tl.uint32, bitcast=True)
    lo = (counter & 0xFFFFFFFF).to(tl.uint32)
    hi = (counter >> 32).to(tl.uint32)
    b0 = mix32(mix32(lo ^ k0) ^ hi)
    b1 = mix32(mix32(lo ^ k1) ^ hi)
    u1 = ((b0 >> 8) + 1).to(tl.float32) * (1.0 / 16777216.0)
    u2 = (b1 >> 8).to(tl.float32) * (1.0 / 16777216.0)
    return tl.sqrt(-2.0 * tl.log(u1)) * tl.cos(6.283185307179586 * u2)
