"""Rotary embedding: native (C++) vs the PyTorch reference, to the bit, on odd shapes; opcheck; dispatch."""

from __future__ import annotations

import pytest
import torch

from flowkit.kernels import rotary as op
from flowkit.kernels.backends import native_has
from flowkit.kernels.reference import rotary as reference

native = pytest.mark.skipif(not native_has("cpu", "rotary"), reason="flowkit._C without rotary")


@native
@pytest.mark.parametrize("rows,heads,dim", [(1, 1, 2), (3, 5, 18), (128, 4, 32), (7, 2, 128), (33, 3, 40)])
def test_native_equals_the_reference_bitwise(rows, heads, dim):
    torch.manual_seed(rows + heads + dim)
    x = torch.randn(rows, heads, dim) * 3
    cos, sin = torch.randn(rows, dim), torch.randn(rows, dim)  # any values: a fused multiply-add would show
    got = torch.ops.flowkit.rotary(x, cos, sin)
    assert torch.equal(got, reference.rotary(x, cos[:, None], sin[:, None]))
    with torch.inference_mode():
        assert op.backend_for(x) == "native"
        assert torch.equal(op.rotary(x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin), got)  # strided x


@native
def test_opcheck_bad_inputs_and_gradients():
    x, cos, sin = torch.randn(3, 2, 8), torch.randn(3, 8), torch.randn(3, 8)
    torch.library.opcheck(torch.ops.flowkit.rotary.default, (x, cos, sin),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="even dim"):
        torch.ops.flowkit.rotary(torch.randn(3, 2, 7), torch.randn(3, 7), torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.flowkit.rotary(x, cos[:2], sin[:2])
    leaf = x.clone().requires_grad_()  # no backward of its own: the reference runs where autograd records
    assert op.backend_for(leaf) == "reference"
    op.rotary(leaf, cos, sin).sum().backward()
    assert leaf.grad is not None


def test_dispatch(monkeypatch):
    assert op.backend_for(torch.randn(2, 1, 4).double()) == "reference"
    monkeypatch.setenv("FLOWKIT_KERNELS", "reference")
    assert op.backend_for(torch.randn(2, 1, 4)) == "reference"
