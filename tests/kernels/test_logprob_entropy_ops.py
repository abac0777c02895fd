"""LM-head softmax op (log p(target), entropy, log-normaliser and the logits' gradient): the native CPU kernel and
the reference against float64 autograd on odd shapes, temperatures and extreme logits; in-place contract, target
checks, the routes that must stay on the reference, opcheck (the LM head that calls it: tests/rl/
test_lm_head_logprobs.py)."""

import pytest
import torch
from kernel_cases import assert_softmax_op_matches_float64, softmax_inputs

from flowkit.kernels import backends, logprob_entropy as op
from flowkit.kernels.reference import logprob_entropy as reference

NATIVE = backends.native_has("cpu", "logprob_entropy")
needs_native = pytest.mark.skipif(not NATIVE, reason="flowkit._C (with logprob_entropy) is not built")
BACKENDS = ["reference"] + (["native"] if NATIVE else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows, vocab, scale, temperature", [(1, 1, 1.0, 1.0), (7, 3, 2.0, 0.7), (37, 1003, 3.0, 1.0),
                                                             (5, 4099, 12.0, 0.3), (3, 32011, 1.0, 1.7)])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_values_and_gradient_match_float64(backend, monkeypatch, rows, vocab, scale, temperature, with_entropy):
    # the entropy's rounding enters the gradient as p·ΔH/T; the kernel computes H from z − max (no cancellation)
    monkeypatch.setenv("FLOWKIT_KERNELS", backend)
    assert_softmax_op_matches_float64(rows, vocab, scale, temperature, with_entropy,
                                      gradient_tolerance=1e-6 if backend == "native" else 1e-5)


@needs_native
def test_native_runs_on_cpu_float32_and_agrees_with_the_reference(monkeypatch):
    calls = []
    real = torch.ops.flowkit.logprob_entropy
    monkeypatch.setattr(torch.ops.flowkit, "logprob_entropy", lambda *args: calls.append(1) or real(*args))
    logits, targets, *_ = softmax_inputs(9, 517, 4.0)
    native = op.logprob_entropy(logits, targets, 0.9)
    assert calls == [1]
    for value, expected in zip(native, reference.logprob_entropy(logits, targets, 0.9)):
        torch.testing.assert_close(value, expected, atol=1e-4, rtol=1e-5)  # |z/T| up to ~20


@needs_native
@pytest.mark.parametrize("logits", [torch.randn(4, 300).t().contiguous().t(), torch.randn(4, 300).double()],
                         ids=["non-contiguous", "float64"])
def test_other_layouts_and_dtypes_take_the_reference(monkeypatch, logits):
    monkeypatch.setattr(torch.ops.flowkit, "logprob_entropy", lambda *args: pytest.fail("took the native kernel"))
    targets = torch.tensor([0, 5, 299, 17])
    logprob, entropy, log_normalizer = op.logprob_entropy(logits, targets, 1.0)
    torch.testing.assert_close(log_normalizer, torch.logsumexp(logits, -1))


@needs_native
def test_extreme_logits_stay_finite():
    """Masked-out vocabulary (−inf and −1e30) and a dominant logit: probabilities underflow to 0, nothing is NaN."""
    logits = torch.randn(3, 2000)
    logits[:, 1000:1500] = -1e30
    logits[:, 1500:] = -float("inf")
    logits[0, 7] = 500.0
    targets = torch.tensor([7, 1, 1999])
    logprob, entropy, log_normalizer = torch.ops.flowkit.logprob_entropy(logits, targets, 1.0)
    assert torch.isfinite(logprob[:2]).all() and torch.isfinite(entropy).all() and logprob[2] < -1e29
    assert abs(logprob[0].item()) < 1e-6 and abs(entropy[0].item()) < 1e-4
    grad = logits.clone()
    torch.ops.flowkit.logprob_entropy_backward_(grad, torch.tensor([7, 1, 2]), log_normalizer, entropy, torch.ones(3),
                                                torch.ones(3), 1.0)
    assert torch.isfinite(grad).all() and (grad[:, 1000:] == 0).all()


@needs_native
def test_targets_outside_the_vocabulary_are_an_error():
    logits = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        torch.ops.flowkit.logprob_entropy(logits, torch.tensor([3, 10]), 1.0)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        torch.ops.flowkit.logprob_entropy_backward_(logits, torch.tensor([-1, 0]), torch.zeros(2), torch.zeros(2),
                                                    torch.ones(2), None, 1.0)


@needs_native
def test_opcheck():
    logits, targets, grad_logprob, grad_entropy = softmax_inputs(6, 257, 2.0)
    torch.library.opcheck(torch.ops.flowkit.logprob_entropy.default, (logits, targets, 0.8))
    _, entropy, log_normalizer = torch.ops.flowkit.logprob_entropy(logits, targets, 0.8)
    torch.library.opcheck(torch.ops.flowkit.logprob_entropy_backward_.default,
                          (logits.clone(), targets, log_normalizer, entropy, grad_logprob, grad_entropy, 0.8))
