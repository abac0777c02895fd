"""Triton kernels vs the reference under TRITON_INTERPRET=1 on CPU tensors (fp32 tight, fp16 loose).

Not collected directly (no ``test_`` prefix): ``test_triton_interpreted.py`` runs this file in a subprocess with
``TRITON_INTERPRET=1`` and ``FLOWKIT_KERNELS=triton``, because the variable must be set before Triton is imported
and must not leak into the rest of the test session. ``opcheck`` of the Triton ops is in the GPU tests: its fake
tensor pass cannot run interpreted kernels.
"""

import os

import pytest
import torch
from kernel_cases import (
    assert_deviation_ops_match_reference,
    assert_softmax_op_matches_float64,
    attention_inputs,
    deviation_inputs,
    deviation_noise,
)

from flowkit.kernels import (
    available_backends,
    flow_token_attention,
    interpolate_latents,
)
from flowkit.kernels.reference import flow_attention as attention_reference

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or "triton" not in available_backends("cpu"),
    reason="run through test_triton_interpreted.py (needs TRITON_INTERPRET=1 and triton)",
)


@pytest.fixture(autouse=True)
def force_triton(monkeypatch):
    monkeypatch.setenv("FLOWKIT_KERNELS", "triton")


def test_prologue_regenerates_the_reference_noise():
    x_t = interpolate_latents(torch.randn(2, 5, 33), torch.zeros(3), seed=2 ** 31 + 9)
    torch.testing.assert_close(x_t.view(2, 3, 5, 33), deviation_noise(2, 3, 5, 33, 2 ** 31 + 9), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("layers, steps, tokens, dim", [(1, 1, 37, 64), (3, 4, 5, 64), (1, 4, 3, 1536)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_velocity_deviation_matches_reference(layers, steps, tokens, dim, dtype, tol):
    assert_deviation_ops_match_reference(*deviation_inputs(layers, steps, tokens, dim, dtype=dtype), tol)


@pytest.mark.parametrize("case", [
    (2, 2, 4, 4, 16, 37, 2), (1, 3, 8, 2, 32, 70, 2), (2, 1, 4, 1, 64, 9, 2),
    (1, 2, 4, 1, 16, 9, 40),  # 160 query rows and 40 flow keys per KV head: 3 row blocks, 2 flow-key blocks
])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 2e-3)])
def test_flow_attention_matches_reference(case, dtype, tol):
    *shape, num_flow = case
    kwargs = attention_inputs(*shape, num_flow=num_flow, dtype=dtype)
    expected = attention_reference.flow_token_attention(**kwargs)
    (expected_grad,) = torch.autograd.grad(expected.float().square().sum(), kwargs["flow_hidden"])
    out = flow_token_attention(**kwargs)
    (grad,) = torch.autograd.grad(out.float().square().sum(), kwargs["flow_hidden"])
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(grad, expected_grad, atol=tol * 5, rtol=tol * 5)


@pytest.mark.parametrize("rows, vocab, scale, temperature", [(1, 1, 1.0, 1.0), (7, 3, 2.0, 0.7), (5, 4099, 12.0, 0.3),
                                                             (3, 9001, 1.0, 1.7)])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_logprob_entropy_matches_float64(rows, vocab, scale, temperature, with_entropy):
    """fp32 only (the op takes float32 logits); 4099 and 9001 span several blocks, so the online maximum rescales."""
    assert_softmax_op_matches_float64(rows, vocab, scale, temperature, with_entropy)
