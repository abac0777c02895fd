"""The counter-based noise (flowkit.kernels.rng): spec, determinism, and agreement across implementations."""

import math

import pytest
import torch
from kernel_cases import deviation_noise

from flowkit.kernels import available_backends, flow_noise, interpolate_latents


def scalar_noise(seed: int, counter: int) -> float:
    """The documented recipe with Python ints and math (independent of the tensor implementation)."""
    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    keys = mix(seed & 0xFFFFFFFF), mix((seed + 0x9E3779B9) & 0xFFFFFFFF)
    lo, hi = counter & 0xFFFFFFFF, counter >> 32
    b0, b1 = (mix(mix(lo ^ k) ^ hi) for k in keys)
    u1, u2 = ((b0 >> 8) + 1) / 2 ** 24, (b1 >> 8) / 2 ** 24
    return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)


@pytest.mark.parametrize("seed, offset", [(0, 0), (1234, 17), (2 ** 31 + 5, 2 ** 32 - 3), (-7, 3 * 2 ** 32)])
def test_matches_the_documented_recipe(seed, offset):
    noise = flow_noise((6,), seed, offset=offset)
    expected = torch.tensor([scalar_noise(seed, offset + i) for i in range(6)])
    torch.testing.assert_close(noise, expected, atol=2e-6, rtol=1e-6)


def test_same_seed_same_noise_and_offsets_slice_the_stream():
    full = flow_noise((4, 50), seed=3)
    assert torch.equal(full, flow_noise((4, 50), seed=3))
    assert torch.equal(flow_noise((30,), seed=3, offset=120), full.flatten()[120:150])
    assert flow_noise((10,), seed=3, dtype=torch.float16).dtype == torch.float16


def test_different_seeds_are_uncorrelated():
    a, b = flow_noise((100_000,), seed=0), flow_noise((100_000,), seed=1)
    assert not torch.equal(a, b)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.02


def test_moments_are_standard_normal():
    noise = flow_noise((200_000,), seed=11).double()
    assert abs(noise.mean()) < 0.01
    assert abs(noise.std() - 1) < 0.01
    assert abs((noise.abs() > 1.96).double().mean() - 0.05) < 0.003


@pytest.mark.parametrize("backend", [b for b in available_backends("cpu") if b != "triton"])
def test_kernels_regenerate_the_same_noise(backend, monkeypatch):
    """x_t at t = 0 is ε itself, so the prologue exposes each implementation's noise."""
    monkeypatch.setenv("FLOWKIT_KERNELS", backend)
    x1 = torch.randn(2, 9, 70)
    x_t = interpolate_latents(x1, torch.tensor([0.0, 0.0, 0.0]), seed=42)
    torch.testing.assert_close(x_t.view(2, 3, 9, 70), deviation_noise(2, 3, 9, 70, seed=42), atol=2e-6, rtol=1e-5)
