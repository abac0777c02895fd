"""Flow-token attention: equality with HF's last-layer attention, native (C++) vs reference, autograd, opcheck."""

import pytest
import torch
from kernel_cases import attention_inputs, core_inputs

from flowkit.kernels import available_backends, flow_token_attention
from flowkit.kernels.reference import flow_attention as reference
from flowkit.llm.tiny import tiny_qwen2

NATIVE = "native" in available_backends("cpu")
needs_native = pytest.mark.skipif(not NATIVE, reason="flowkit._C is not built")
CPU_BACKENDS = [b for b in available_backends("cpu") if b != "triton"]


def hf_context(model, input_ids):
    """Normalised input of the last layer's self_attn and the K/V HF caches for it."""
    captured = {}
    attn = model.model.layers[-1].self_attn
    handle = attn.register_forward_pre_hook(lambda m, args, kwargs: captured.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=True)
    handle.remove()
    cache = out.past_key_values.layers[-1]
    return captured["hidden_states"], cache.keys, cache.values


def hf_flow_attention(model, context_hidden, flow_hidden, length, positions):
    """Naive path: append the flow tokens after context[:length] and run HF's last-layer attention with the mask."""
    attn = model.model.layers[-1].self_attn
    seq = torch.cat((context_hidden[:length], flow_hidden)).unsqueeze(0)
    position_ids = torch.cat((torch.arange(length), positions)).unsqueeze(0)
    total, num_flow = seq.shape[1], flow_hidden.shape[0]
    allowed = torch.ones(total, total).tril().bool()
    allowed[length:, :] = True  # flow tokens see the prefix and each other
    mask = torch.zeros(total, total).masked_fill(~allowed, torch.finfo(torch.float32).min).view(1, 1, total, total)
    cos_sin = model.model.rotary_emb(seq, position_ids)
    with torch.no_grad():
        out, _ = attn(hidden_states=seq, position_embeddings=cos_sin, attention_mask=mask)
    return out[0, -num_flow:]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_equals_hf_last_layer_attention(kv_heads, backend, monkeypatch):
    torch.manual_seed(0)
    model = tiny_qwen2(vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=kv_heads,
                       intermediate_size=128).eval()
    batch, context, steps, num_flow = 2, 12, 3, 2
    context_hidden, context_k, context_v = hf_context(model, torch.randint(4, 40, (batch, context)))
    flow_hidden = torch.randn(batch, steps, num_flow, 64)
    prefix = torch.tensor([[12, 5, 1], [7, 12, 3]])
    positions = prefix.unsqueeze(-1) + torch.arange(num_flow)
    positions[1, 2] = torch.tensor([20, 21])  # flow tokens may sit at any given positions
    attn = model.model.layers[-1].self_attn
    rope = model.model.rotary_emb
    monkeypatch.setenv("FLOWKIT_KERNELS", backend)
    out = flow_token_attention(
        flow_hidden, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.q_proj.bias, attn.k_proj.bias,
        attn.v_proj.bias, context_k, context_v, prefix, positions, rope.inv_freq, rope.attention_scaling,
        num_heads=4, num_kv_heads=kv_heads)
    assert out.shape == (batch, steps, num_flow, 64)
    with torch.no_grad():
        projected = attn.o_proj(out)
    for b in range(batch):
        for s in range(steps):
            expected = hf_flow_attention(model, context_hidden[b], flow_hidden[b, s], int(prefix[b, s]), positions[b, s])
            torch.testing.assert_close(projected[b, s], expected, atol=1e-5, rtol=1e-4)


def test_only_flow_hidden_receives_gradient():
    kwargs = attention_inputs(1, 2, 4, 2, 8, 6)
    kwargs["q_weight"].requires_grad_()
    kwargs["context_k"].requires_grad_()
    flow_token_attention(**kwargs).sum().backward()
    assert kwargs["flow_hidden"].grad is not None and kwargs["flow_hidden"].grad.abs().sum() > 0
    assert kwargs["q_weight"].grad is None and kwargs["context_k"].grad is None


CASES = [  # batch, steps, heads, kv_heads, head_dim, context (GQA ratios 1 and 4, N off any block size)
    (2, 3, 4, 4, 16, 37),
    (1, 5, 8, 2, 32, 70),
    (3, 2, 4, 1, 64, 9),
]


@needs_native
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 2e-3)])
def test_native_matches_reference(case, dtype, tol, monkeypatch):
    kwargs = attention_inputs(*case, dtype=dtype, bias=case[0] != 1)
    expected = reference.flow_token_attention(**kwargs)
    (expected_grad,) = torch.autograd.grad(expected.float().square().sum(), kwargs["flow_hidden"])
    monkeypatch.setenv("FLOWKIT_KERNELS", "native")
    out = flow_token_attention(**kwargs)
    (grad,) = torch.autograd.grad(out.float().square().sum(), kwargs["flow_hidden"])
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(grad, expected_grad, atol=tol * 5, rtol=tol * 5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradcheck_float64(backend, monkeypatch):
    monkeypatch.setenv("FLOWKIT_KERNELS", backend)
    kwargs = attention_inputs(2, 2, 4, 2, 4, 5, dtype=torch.float64)
    hidden = kwargs.pop("flow_hidden")
    assert torch.autograd.gradcheck(lambda h: flow_token_attention(h, **kwargs), (hidden,), fast_mode=True)


@needs_native
def test_native_core_gradcheck_and_opcheck():
    q, fk, fv, ck, cv, prefix = core_inputs(2, 2, 4, 2, 8, 7)
    q, fk, fv = (t.requires_grad_() for t in (q, fk, fv))
    assert torch.autograd.gradcheck(
        lambda q, fk, fv: torch.ops.flowkit.flow_attention(q, fk, fv, ck, cv, prefix)[0], (q, fk, fv), fast_mode=True)
    torch.library.opcheck(torch.ops.flowkit.flow_attention.default, (q, fk, fv, ck, cv, prefix))
    out, lse = torch.ops.flowkit.flow_attention(q, fk, fv, ck, cv, prefix)
    torch.library.opcheck(torch.ops.flowkit.flow_attention_backward.default,
                          (torch.randn_like(out), q.detach(), fk.detach(), fv.detach(), ck, cv, prefix, out.detach(), lse.detach()))


@needs_native
def test_native_rejects_inputs_that_do_not_match():
    """The kernels index raw pointers with q's sizes: mismatched inputs are an error, checked once for CPU and CUDA."""
    q, fk, fv, ck, cv, prefix = core_inputs(2, 2, 4, 2, 8, 7, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="context_k / context_v must be"):
        torch.ops.flowkit.flow_attention(q, fk, fv, ck[..., :4], cv[..., :4], prefix)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.flowkit.flow_attention(q, fk, fv.double(), ck, cv, prefix)
    out, lse = torch.ops.flowkit.flow_attention(q, fk, fv, ck, cv, prefix)
    with pytest.raises(RuntimeError, match="lse must be"):
        torch.ops.flowkit.flow_attention_backward(torch.ones_like(out), q, fk, fv, ck, cv, prefix, out, lse[:, :1])
