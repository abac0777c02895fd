"""flowkit.kernels.cpu_linear: the oneDNN float32 linear and its gradients against a float64 ``F.linear`` on odd
shapes, the products that must stay on ``F.linear``, and a model whose layers it runs."""

import copy

import pytest
import torch
import torch.nn.functional as F

from flowkit.kernels import cpu_linear
from flowkit.llm.backbone import load_backbone
from flowkit.rl.logprobs import lm_head_logprobs

pytestmark = pytest.mark.skipif(cpu_linear._ONEDNN_LINEAR is None, reason="this torch has no oneDNN")


@pytest.fixture
def onednn_calls(monkeypatch):
    """Counts the oneDNN calls, so a test sees which products took it; products take it from 2^21 multiply-adds
    (Zen 5's threshold) whatever this machine's."""
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", 1 << 21)
    calls = []
    real = cpu_linear._ONEDNN_LINEAR

    def counted(x, weight, *args):
        calls.append((tuple(x.shape), tuple(weight.shape)))
        return real(x, weight, *args)

    monkeypatch.setattr(cpu_linear, "_ONEDNN_LINEAR", counted)
    return calls


ZEN5 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
ZEN4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
XEON = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"


@pytest.mark.parametrize("cpuinfo, threshold", [(ZEN5, 1 << 21), (ZEN4, 1 << 26), (XEON, 1 << 26), ("", 1 << 26)])
def test_the_threshold_follows_the_cpu(cpuinfo, threshold):
    assert cpu_linear.onednn_min_macs(cpuinfo) == threshold


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.detach().double() - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize("lead, k, n, bias", [((3, 333), 130, 67, True), ((1031,), 97, 513, False),
                                              ((2, 5, 61), 257, 129, True), ((37,), 61, 4099, False)])
def test_forward_and_gradients_match_float64(onednn_calls, lead, k, n, bias):
    torch.manual_seed(0)
    x = torch.randn(*lead, k, requires_grad=True)
    weight = torch.randn(n, k, requires_grad=True)
    b = torch.randn(n, requires_grad=True) if bias else None
    out = cpu_linear.linear(x, weight, b)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert len(onednn_calls) == 3  # the forward and both gradient products
    rows = x[..., 0].numel()
    assert onednn_calls[2][0] == (min(k, n), rows)  # the weight's gradient copies the narrower operand
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    reference = F.linear(x64, w64, b64)
    reference.backward(grad.double())
    assert out.shape == reference.shape
    pairs = [(out, reference), (x.grad, x64.grad), (weight.grad, w64.grad)] + ([(b.grad, b64.grad)] if bias else [])
    for value, expected in pairs:
        assert _relative_error(value, expected) < 2e-6


def test_a_broadcast_gradient_reaches_onednn_as_dense_operands(monkeypatch):
    """``out.sum().backward()`` hands the backward a gradient of stride 0; oneDNN given it as an operand crawls
    (6.9 s instead of ~20 ms at 4096 × 128 × 512), so every operand it gets has non-zero strides."""
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", 1 << 21)
    strides = []
    real = cpu_linear._ONEDNN_LINEAR

    def recorded(x, weight, *args):
        strides.append(x.stride() + weight.stride())
        return real(x, weight, *args)

    monkeypatch.setattr(cpu_linear, "_ONEDNN_LINEAR", recorded)
    for k, n in ((128, 512), (512, 128)):  # the weight gradient's copied operand: x, then the gradient
        x = torch.randn(1100, k, requires_grad=True)
        weight = torch.randn(n, k, requires_grad=True)
        cpu_linear.linear(x, weight).sum().backward()
        assert torch.allclose(weight.grad, x.detach().sum(0).expand(n, k), rtol=1e-4, atol=1e-3)
    assert len(strides) == 6 and all(min(s) > 0 for s in strides)


def test_frozen_weight_and_inference_take_onednn_without_the_weight_gradient(onednn_calls):
    x = torch.randn(300, 128, requires_grad=True)
    weight = torch.randn(512, 128)
    cpu_linear.linear(x, weight).sum().backward()
    assert len(onednn_calls) == 2 and weight.grad is None  # forward and the input's gradient only
    with torch.no_grad():
        assert torch.allclose(cpu_linear.linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-4)
    assert len(onednn_calls) == 3


def test_what_stays_on_f_linear(onednn_calls, monkeypatch):
    small = torch.randn(8, 64), torch.randn(32, 64)  # 16k multiply-adds: call overhead
    assert torch.equal(cpu_linear.linear(*small), F.linear(*small))
    x, weight = torch.randn(300, 128), torch.randn(512, 128)
    assert torch.equal(cpu_linear.linear(x.double(), weight.double()), F.linear(x.double(), weight.double()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_linear.linear(x, weight).dtype == torch.bfloat16  # autocast's cast, as nn.Linear
    monkeypatch.setenv("FLOWKIT_KERNELS", "reference")
    assert torch.equal(cpu_linear.linear(x, weight), F.linear(x, weight))
    assert onednn_calls == []
    monkeypatch.delenv("FLOWKIT_KERNELS")
    cpu_linear.linear(x, weight)
    assert onednn_calls == [((300, 128), (512, 128))]


def test_a_backbone_runs_its_linears_through_onednn(onednn_calls):
    model, _ = load_backbone("bundled:tiny_adder")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is cpu_linear.OneDNNLinear for m in linears)
    plain = copy.deepcopy(model)
    for module in plain.modules():
        if type(module) is cpu_linear.OneDNNLinear:
            module.__class__ = torch.nn.Linear
    assert plain.state_dict().keys() == model.state_dict().keys()
    ids = torch.randint(3, 25, (6, 40))
    model(input_ids=ids).logits.square().mean().backward()
    assert onednn_calls  # 240 rows × 128 × 512 in the MLP
    plain(input_ids=ids).logits.square().mean().backward()
    for (name, param), plain_param in zip(model.named_parameters(), plain.parameters()):
        scale = float(plain_param.grad.abs().max())
        assert torch.allclose(param.grad, plain_param.grad, rtol=1e-4, atol=1e-6 * scale), name
    copied = copy.deepcopy(model)  # a copy keeps the class and runs its own parameters
    assert type(copied.lm_head) is cpu_linear.OneDNNLinear and copied.lm_head.weight is not model.lm_head.weight


def test_lm_head_logprobs_equal_the_reference_path(monkeypatch):
    torch.manual_seed(1)
    head = torch.nn.Linear(96, 700, bias=False)  # 3,000 rows × 96 × 700: every product through oneDNN
    hidden = torch.randn(1, 3001, 96)
    ids = torch.randint(0, 700, (1, 3001))
    mask = torch.ones(1, 3001, dtype=torch.long)

    def run():
        states = hidden.clone().requires_grad_()
        head.zero_grad()
        picked, entropy = lm_head_logprobs(states, head, ids, mask, chunk_size=1024, entropy_gradient=True)
        (picked.sum() + entropy.sum()).backward()
        return picked.detach(), entropy.detach(), states.grad, head.weight.grad.clone()

    fast = run()
    monkeypatch.setenv("FLOWKIT_KERNELS", "reference")
    reference = run()
    for value, expected in zip(fast, reference):
        assert torch.allclose(value, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
