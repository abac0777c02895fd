"""Short-sequence attention: native (C++) vs SDPA with grouped heads, values and gradients on odd shapes; opcheck."""

from __future__ import annotations

import pytest
import torch

from flowkit.kernels import short_attention as op
from flowkit.kernels.backends import native_has
from flowkit.kernels.reference import short_attention as reference

native = pytest.mark.skipif(not native_has("cpu", "short_attention"), reason="flowkit._C without short_attention")


def inputs(rows, heads, kv_heads, queries, keys, dim, seed):
    """Queries in transformers' layout (a transposed view), keys and values, a mask that keeps the last key of every
    query (a causal mask's diagonal) and drops others at random, broadcast over the rows where ``rows`` is odd."""
    torch.manual_seed(seed)
    query = torch.randn(rows, queries, heads, dim).transpose(1, 2).requires_grad_()
    key = torch.randn(rows, kv_heads, keys, dim, requires_grad=True)
    value = torch.randn(rows, kv_heads, keys, dim, requires_grad=True)
    mask = torch.rand(1 if rows % 2 else rows, 1, queries, keys) < 0.7
    mask[..., -1] = True
    return query, key, value, mask.expand(rows, 1, queries, keys)


@native
@pytest.mark.parametrize("rows,heads,kv_heads,queries,keys,dim", [
    (1, 1, 1, 1, 1, 32), (3, 4, 2, 5, 9, 32), (2, 6, 2, 17, 33, 64), (1, 3, 1, 3, 40, 128), (4, 4, 4, 7, 16, 32),
    (5, 6, 3, 29, 47, 32)])
def test_native_matches_the_reference(rows, heads, kv_heads, queries, keys, dim):
    query, key, value, mask = inputs(rows, heads, kv_heads, queries, keys, dim, seed=queries * keys)
    grad = torch.randn(rows, queries, heads, dim)
    assert op.backend_for(query, key) == "native"
    got = op.short_attention(query, key, value, mask, dim ** -0.5)
    expected = reference.short_attention(query, key, value, mask, dim ** -0.5)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
    for ours, theirs in zip(torch.autograd.grad(got, (query, key, value), grad),
                            torch.autograd.grad(expected, (query, key, value), grad)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@native
def test_a_query_with_every_key_masked_gets_zeros_and_no_gradient():
    query, key, value, mask = inputs(2, 2, 1, 4, 6, 32, seed=3)
    mask = mask.clone()
    mask[1, 0, 2] = False
    out = op.short_attention(query, key, value, mask, 0.2)
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2]))
    torch.testing.assert_close(out[0], reference.short_attention(query, key, value, mask, 0.2)[0])
    grad = torch.zeros_like(out)
    grad[1, 2] = 1.0  # only the masked query's output: it reads nothing
    grads = torch.autograd.grad(out, (query, key, value), grad)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@native
def test_opcheck_and_bad_inputs():
    query, key, value, mask = (t.detach() for t in inputs(2, 4, 2, 3, 5, 32, seed=1))
    torch.library.opcheck(torch.ops.flowkit.short_attention.default, (query, key, value, mask, 0.25))
    out, lse = torch.ops.flowkit.short_attention(query, key, value, mask, 0.25)
    torch.library.opcheck(torch.ops.flowkit.short_attention_backward.default,
                          (torch.randn_like(out), query, key, value, out, lse, mask, 0.25))
    with pytest.raises(RuntimeError, match="head dimension 32, 64 or 128"):
        torch.ops.flowkit.short_attention(query[..., :16], key[..., :16], value[..., :16], mask, 0.25)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        torch.ops.flowkit.short_attention(query, key, value, mask.float(), 0.25)
    with pytest.raises(RuntimeError, match="Hkv dividing H"):
        torch.ops.flowkit.short_attention(query[:, :3], key, value, mask, 0.25)


def test_dispatch(monkeypatch):
    query, key = torch.randn(1, 2, 3, 32), torch.randn(1, 1, 5, 32)
    assert op.backend_for(query[..., :16], key[..., :16]) == "reference"  # a head dimension it is not built for
    assert op.backend_for(query, torch.randn(1, 1, op.MAX_KEYS + 1, 32)) == "reference"
    assert op.backend_for(query.double(), key.double()) == "reference"
    monkeypatch.setenv("FLOWKIT_KERNELS", "reference")
    assert op.backend_for(query, key) == "reference"
