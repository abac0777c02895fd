"""One decoding step's attention: native (C++) vs the SDPA reference on odd shapes, strided cache views, masks; opcheck."""

from __future__ import annotations

import pytest
import torch

from flowkit.kernels import decode_attention as op
from flowkit.kernels.backends import native_has
from flowkit.kernels.reference import decode_attention as reference

native = pytest.mark.skipif(not native_has("cpu", "decode_attention"), reason="flowkit._C without decode_attention")


def inputs(rows, kv_heads, group, dim, length, padded, capacity=None):
    """A query and a KV cache's filled positions, as views of buffers reserved for ``capacity`` positions."""
    capacity = capacity or length + 5
    query = torch.randn(rows, kv_heads, group, dim)
    keys = torch.randn(rows, kv_heads, capacity, dim)[:, :, :length]
    values = torch.randn(rows, kv_heads, capacity, dim)[:, :, :length]
    mask = None
    if padded:
        mask = torch.ones(rows, length, dtype=torch.bool)
        for row in range(rows):
            mask[row, :row % min(length, 4)] = False  # left padding, each row keeps its last key
    return query, keys, values, mask


@native
@pytest.mark.parametrize("rows,kv_heads,group,dim,length", [
    (1, 1, 1, 8, 1), (5, 3, 1, 24, 7), (7, 2, 2, 32, 33), (3, 1, 3, 40, 70), (2, 2, 4, 128, 129), (4, 1, 5, 20, 2),
    (3, 2, 2, 64, 16), (2, 1, 2, 64, 47), (6, 2, 2, 32, 1)])
@pytest.mark.parametrize("padded", [True, False], ids=["mask", "no-mask"])
def test_native_matches_the_reference(rows, kv_heads, group, dim, length, padded):
    torch.manual_seed(rows * 100 + length)
    query, keys, values, mask = inputs(rows, kv_heads, group, dim, length, padded)
    scale = dim ** -0.5
    got = torch.ops.flowkit.decode_attention(query, keys, values, mask, scale)
    expected = reference.decode_attention(query, keys, values, mask, scale)
    assert got.shape == expected.shape == query.shape
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
    if padded:  # a masked key changes nothing, whatever it holds
        keys[~mask[:, None, :, None].expand_as(keys)] = 1e4
        torch.testing.assert_close(torch.ops.flowkit.decode_attention(query, keys, values, mask, scale), got)


@native
@pytest.mark.parametrize("dim,length", [(32, 45), (64, 17), (128, 31)])
def test_keys_masked_anywhere(dim, length):
    """Masked keys in every block of 16 the kernel scores at once, the last block partly past the end."""
    torch.manual_seed(dim + length)
    query, keys, values, _ = inputs(5, 2, 2, dim, length, padded=False)
    mask = torch.rand(5, length) < 0.6
    mask[:, -1] = True
    got = torch.ops.flowkit.decode_attention(query, keys, values, mask, dim ** -0.5)
    torch.testing.assert_close(got, reference.decode_attention(query, keys, values, mask, dim ** -0.5),
                               rtol=2e-6, atol=2e-6)


@native
def test_a_row_with_every_key_masked_gives_zeros():
    query, keys, values, _ = inputs(2, 2, 2, 16, 5, padded=False)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1] = False
    out = torch.ops.flowkit.decode_attention(query, keys, values, mask, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0], reference.decode_attention(query, keys, values, mask, 0.25)[0])


@native
def test_opcheck_and_bad_inputs():
    query, keys, values, mask = inputs(3, 2, 2, 16, 9, padded=True)
    torch.library.opcheck(torch.ops.flowkit.decode_attention.default, (query, keys, values, mask, 0.25))
    torch.library.opcheck(torch.ops.flowkit.decode_attention.default, (query, keys, values, None, 0.25))
    with pytest.raises(RuntimeError, match="mask must be bool"):
        torch.ops.flowkit.decode_attention(query, keys, values, mask.float(), 0.25)
    with pytest.raises(RuntimeError, match="keys and values must be"):
        torch.ops.flowkit.decode_attention(query, keys[:, :1], values[:, :1], mask, 0.25)


def test_dispatch(monkeypatch):
    query = torch.randn(2, 1, 2, 32)
    assert op.backend_for(query.double()) == "reference"
    assert op.backend_for(torch.randn(2, 1, 2, 40)) == "reference"  # a head dimension it is not compiled for
    assert op.backend_for(query) == ("native" if native_has("cpu", "decode_attention") else "reference")
    monkeypatch.setenv("FLOWKIT_KERNELS", "reference")
    assert op.backend_for(query) == "reference"
