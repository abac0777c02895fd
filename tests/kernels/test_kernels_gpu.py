"""CUDA checks (skipped without a GPU): native CUDA ops and compiled Triton vs the reference, opcheck, dispatch."""

import pytest
import torch
from kernel_cases import (
    assert_deviation_ops_match_reference,
    assert_softmax_op_matches_float64,
    attention_inputs,
    core_inputs,
    deviation_inputs,
    deviation_noise,
    softmax_inputs,
)

from flowkit.kernels import (
    available_backends,
    backends,
    flow_token_attention,
    interpolate_latents,
)
from flowkit.kernels.reference import flow_attention as attention_reference

pytestmark = pytest.mark.gpu
GPU_BACKENDS = ["native", "triton"]
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]  # fp16 is covered on CPU (C++ and interpreted Triton)


def require(backend):
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} is not available for CUDA tensors")


def test_cuda_build_is_present():
    assert backends.native_has("cuda"), "flowkit._C was built without CUDA kernels"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_noise_is_the_same_on_gpu(backend, monkeypatch):
    require(backend)
    monkeypatch.setenv("FLOWKIT_KERNELS", backend)
    x_t = interpolate_latents(torch.randn(2, 9, 70, device="cuda"), torch.zeros(3, device="cuda"), seed=2 ** 31 + 1)
    torch.testing.assert_close(x_t.view(2, 3, 9, 70).cpu(), deviation_noise(2, 3, 9, 70, 2 ** 31 + 1), atol=5e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("shape", [(1, 1, 37, 64), (3, 4, 130, 64), (3, 4, 33, 1536)])
@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_velocity_deviation_matches_reference(backend, shape, dtype, tol, monkeypatch):
    require(backend)
    x1, ts, w, mask, v = deviation_inputs(*shape, dtype=dtype, device="cuda")
    monkeypatch.setenv("FLOWKIT_KERNELS", backend)
    assert_deviation_ops_match_reference(x1, ts, w, mask, v, tol)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("case", [(2, 3, 4, 4, 64, 37), (2, 5, 8, 2, 128, 300), (1, 4, 16, 4, 128, 1000),
                                  (1, 2, 8, 2, 128, 300, 32)])  # 128 query rows per KV head: above one block
@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_flow_attention_matches_reference(backend, case, dtype, tol, monkeypatch):
    require(backend)
    kwargs = attention_inputs(*case, dtype=dtype, device="cuda")
    expected = attention_reference.flow_token_attention(**kwargs)
    (expected_grad,) = torch.autograd.grad(expected.float().square().sum(), kwargs["flow_hidden"])
    monkeypatch.setenv("FLOWKIT_KERNELS", backend)
    out = flow_token_attention(**kwargs)
    (grad,) = torch.autograd.grad(out.float().square().sum(), kwargs["flow_hidden"])
    torch.testing.assert_close(out, expected, atol=tol * 2, rtol=tol * 2)
    torch.testing.assert_close(grad, expected_grad, atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("case", [
    (1, 2, 4, 1, 128, 1000, 64),  # 256 query rows per (b, s, kv head): GQA 4 x 64 flow tokens, 16 row blocks each
    (2, 1, 2, 2, 128, 77, 300),   # 300 rows and 300 flow keys per task: 19 row and 19 key blocks, the last partial
])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 5e-5), (torch.bfloat16, 2e-2)])  # C++ on CPU: 6e-7, 4e-3
def test_native_flow_attention_above_the_old_shared_memory_limit(case, dtype, tol):
    """Head dim 128 with more query rows per task than the kernels once held in one block's shared memory (~193
    forward, fewer backward: a launch failure), against the float64 reference; the backward is the same bitwise on
    a second run (no atomics)."""
    if not backends.native_has("cuda"):
        pytest.skip("no CUDA build")
    *shape, num_flow = case
    inputs = [t.cuda() for t in core_inputs(*shape, num_flow=num_flow, dtype=torch.float64)]
    leaves = [t.clone().requires_grad_() for t in inputs[:3]]
    expected = attention_reference.attention_core(*leaves, *inputs[3:])
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    cast = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    q, fk, fv = (t.requires_grad_() for t in cast[:3])
    out, _ = torch.ops.flowkit.flow_attention(q, fk, fv, *cast[3:])
    grads = torch.autograd.grad(out, (q, fk, fv), grad_out.to(dtype), retain_graph=True)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), expected_grad, atol=tol, rtol=tol)
    again = torch.autograd.grad(out, (q, fk, fv), grad_out.to(dtype))
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_native_flow_attention_names_the_shared_memory_limit():
    """A head dim whose K/V tiles alone exceed a block's shared memory is a clear error, not a launch failure."""
    if not backends.native_has("cuda"):
        pytest.skip("no CUDA build")
    q, fk, fv, ck, cv, prefix = (t.cuda() for t in core_inputs(1, 1, 1, 1, 8192, 3, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="cudaDevAttrMaxSharedMemoryPerBlockOptin"):
        torch.ops.flowkit.flow_attention(q, fk, fv, ck, cv, prefix)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_opcheck(backend):
    require(backend)
    x1, ts, w, mask, v = deviation_inputs(2, 3, 6, 20, device="cuda")
    v, mask = v.detach().requires_grad_(), mask.float()
    q, fk, fv, ck, cv, prefix = (t.cuda() for t in core_inputs(2, 2, 4, 2, 16, 7, dtype=torch.float32))
    q = q.requires_grad_()
    if backend == "native":
        ops = torch.ops.flowkit
        torch.library.opcheck(ops.interpolate_latents.default, (x1, ts, 4, 3))
        torch.library.opcheck(ops.velocity_deviation.default, (v, x1, ts, w, 4, 3, mask))
        torch.library.opcheck(ops.flow_attention.default, (q, fk, fv, ck, cv, prefix))
    else:
        from flowkit.kernels.triton import flow_attention
        from flowkit.kernels.triton import velocity_deviation as triton_deviation

        from flowkit.kernels.triton import logprob_entropy

        torch.library.opcheck(triton_deviation.velocity_deviation, (v, x1, ts, w, 4, 3, mask))
        torch.library.opcheck(flow_attention.flow_attention_core, (q, fk, fv, ck, cv, prefix))
        logits, targets, grad_logprob, grad_entropy = softmax_inputs(6, 5000, 2.0, device="cuda")
        _, entropy, log_normalizer = logprob_entropy.logprob_entropy(logits, targets, 0.8)
        torch.library.opcheck(logprob_entropy.logprob_entropy, (logits, targets, 0.8))
        torch.library.opcheck(logprob_entropy.logprob_entropy_backward_,
                              (logits.clone(), targets, log_normalizer, entropy, grad_logprob, grad_entropy, 0.8))


@pytest.mark.parametrize("rows, vocab, scale, temperature", [(7, 3, 2.0, 0.7), (33, 152_064, 4.0, 1.0),
                                                             (5, 4099, 12.0, 0.3)])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_logprob_entropy_matches_float64(rows, vocab, scale, temperature, with_entropy):
    """The LM head's softmax on CUDA (Triton: there is no native CUDA kernel), Qwen2's vocabulary among the shapes."""
    require("triton")
    assert_softmax_op_matches_float64(rows, vocab, scale, temperature, with_entropy, device="cuda")


def test_native_cuda_gradcheck_float64():
    if not backends.native_has("cuda"):
        pytest.skip("no CUDA build")
    x1, ts, w, mask, v = deviation_inputs(2, 2, 4, 5, dtype=torch.float64, device="cuda")
    assert torch.autograd.gradcheck(lambda v: torch.ops.flowkit.velocity_deviation(v, x1, ts, w, 7, 0, mask.float()), (v,))
    q, fk, fv, ck, cv, prefix = (t.cuda() for t in core_inputs(2, 2, 4, 2, 8, 7))
    q, fk, fv = (t.requires_grad_() for t in (q, fk, fv))
    assert torch.autograd.gradcheck(
        lambda q, fk, fv: torch.ops.flowkit.flow_attention(q, fk, fv, ck, cv, prefix)[0], (q, fk, fv), fast_mode=True)
