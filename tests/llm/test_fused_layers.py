"""Fused RMSNorm and SwiGLU modules: HF's forward and gradients to rounding, its exactly off the native kernels."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowkit.kernels.backends import native_has
from flowkit.llm.fused_layers import FusedRMSNorm, FusedSwiGLUMLP, use_fused_layers
from flowkit.llm.tiny import tiny_qwen2


def models():
    torch.manual_seed(0)
    yield tiny_qwen2(41, hidden_size=64, num_layers=2, intermediate_size=96)
    yield LlamaForCausalLM(LlamaConfig(vocab_size=41, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, mlp_bias=True))


def loss_and_grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.square().mean().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("model", models(), ids=["qwen2", "llama"])
def test_fused_layers_keep_the_forward_and_gradients(model, monkeypatch):
    fused = copy.deepcopy(model)
    assert use_fused_layers(fused) == 2 * 3 + 1
    assert sum(isinstance(m, FusedRMSNorm | FusedSwiGLUMLP) for m in fused.modules()) == 7
    assert fused.state_dict().keys() == model.state_dict().keys()
    ids = torch.randint(0, 41, (3, 13))
    logits, grads = loss_and_grads(model, ids)
    fused_logits, fused_grads = loss_and_grads(fused, ids)
    torch.testing.assert_close(fused_logits, logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6)
    if native_has("cpu", "swiglu"):
        assert not torch.equal(fused_logits, logits)  # the native kernels ran
    monkeypatch.setenv("FLOWKIT_KERNELS", "reference")
    reference_logits, reference_grads = loss_and_grads(fused, ids)
    assert torch.equal(reference_logits, logits)
    assert all(torch.equal(reference_grads[name], grad) for name, grad in grads.items())
