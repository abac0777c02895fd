"""SwiGLU and RMSNorm: native (C++) vs the PyTorch reference, values and gradients on odd shapes; opcheck; dispatch."""

from __future__ import annotations

import pytest
import torch

from flowkit.kernels import rms_norm as norm_op
from flowkit.kernels import swiglu as swiglu_op
from flowkit.kernels.backends import native_has
from flowkit.kernels.reference import rms_norm as norm_reference
from flowkit.kernels.reference import swiglu as swiglu_reference

native = pytest.mark.skipif(not (native_has("cpu", "swiglu") and native_has("cpu", "rms_norm")),
                            reason="flowkit._C without swiglu / rms_norm")
SHAPES = [(1, 1), (3, 7), (5, 11, 130), (2, 3, 4, 17), (1031, 40)]


def leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


@native
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_and_its_gradients_match_the_reference(shape):
    torch.manual_seed(len(shape) * 31 + shape[-1])
    gate, up = torch.randn(shape) * 4, torch.randn(shape)  # gates far into both tails of the sigmoid
    gate[..., 0] = 90.0  # past the exponential's range on either side
    gate.view(-1)[-1] = -90.0
    grad = torch.randn(shape)
    (g1, u1), (g2, u2) = leaves(gate, up), leaves(gate, up)
    assert swiglu_op.backend_for(g1) == "native"
    out = swiglu_op.swiglu(g1, u1)
    expected = swiglu_reference.swiglu(g2, u2)
    torch.testing.assert_close(out, expected, rtol=3e-6, atol=1e-6)
    with torch.no_grad():  # the op itself, without the autograd Function: the same values
        assert torch.equal(swiglu_op.swiglu(g1, u1), out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(g1.grad, g2.grad, rtol=3e-6, atol=1e-6)
    torch.testing.assert_close(u1.grad, u2.grad, rtol=3e-6, atol=1e-6)


@native
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_and_its_gradients_match_the_reference(shape):
    torch.manual_seed(len(shape) * 17 + shape[-1])
    x, weight, grad = torch.randn(shape) * 3, torch.randn(shape[-1]), torch.randn(shape)
    (x1, w1), (x2, w2) = leaves(x, weight), leaves(x, weight)
    assert norm_op.backend_for(x1) == "native"
    out = norm_op.rms_norm(x1, w1, 1e-6)
    expected = norm_reference.rms_norm(x2, w2, 1e-6)
    assert torch.ops.flowkit.rms_norm(x, weight, 1e-6)[1].shape == shape[:-1]
    torch.testing.assert_close(out, expected, rtol=3e-6, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(norm_op.rms_norm(x1, w1, 1e-6), out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-4)


@native
def test_opcheck_and_bad_inputs():
    gate, up = torch.randn(4, 9), torch.randn(4, 9)
    torch.library.opcheck(torch.ops.flowkit.swiglu.default, (gate, up))
    torch.library.opcheck(torch.ops.flowkit.swiglu_backward.default, (torch.randn(4, 9), gate, up))
    x, weight = torch.randn(2, 3, 8), torch.randn(8)
    torch.library.opcheck(torch.ops.flowkit.rms_norm.default, (x, weight, 1e-5))
    _, inverse_rms = torch.ops.flowkit.rms_norm(x, weight, 1e-5)
    torch.library.opcheck(torch.ops.flowkit.rms_norm_backward.default, (torch.randn(2, 3, 8), x, weight, inverse_rms))
    with pytest.raises(RuntimeError, match="contiguous float32 tensors of one shape"):
        torch.ops.flowkit.swiglu(gate, up[:, :4])
    with pytest.raises(RuntimeError, match="rms_norm takes"):
        torch.ops.flowkit.rms_norm(x, torch.randn(7), 1e-5)


def test_dispatch(monkeypatch):
    x = torch.randn(3, 8)
    assert swiglu_op.backend_for(x.double()) == norm_op.backend_for(x.double()) == "reference"
    expected = "native" if native_has("cpu", "swiglu") else "reference"
    assert swiglu_op.backend_for(x) == norm_op.backend_for(x) == expected
    torch.testing.assert_close(swiglu_op.swiglu(x, x.t().contiguous().t()), swiglu_reference.swiglu(x, x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert swiglu_op.backend_for(x) == norm_op.backend_for(x) == "reference"
    monkeypatch.setenv("FLOWKIT_KERNELS", "reference")
    assert swiglu_op.backend_for(x) == norm_op.backend_for(x) == "reference"
