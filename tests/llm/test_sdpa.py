"""flowkit's sdpa: transformers' sdpa outputs to the bit and gradients to rounding, without copies of the KV heads."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowkit.batch import RolloutBatch
from flowkit.llm import sdpa
from flowkit.llm.backbone import load_backbone
from flowkit.llm.kv_cache import cache_argument, forward_hidden_shared_prompts
from flowkit.llm.sdpa import FLOWKIT_SDPA, SHORT_KEYS, use_flowkit_sdpa
from flowkit.llm.tiny import tiny_qwen2


def models():
    torch.manual_seed(0)
    yield tiny_qwen2(41, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)
    yield LlamaForCausalLM(LlamaConfig(vocab_size=41, hidden_size=96, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=6, num_key_value_heads=2))


def left_padded(rows: int, columns: int, vocab: int = 41) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, vocab, (rows, columns))
    mask = torch.ones_like(ids)
    for row in range(rows):
        mask[row, :row % 4] = 0
    return ids, mask


def logits_and_grads(model, ids, mask):
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    (logits * mask[..., None]).square().mean().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture
def fallbacks(monkeypatch):
    """The attention calls flowkit's sdpa hands to transformers' own."""
    calls = []
    forward = sdpa.sdpa_attention_forward
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    return calls


@pytest.mark.parametrize("model", models(), ids=["qwen2", "llama"])
def test_flowkit_sdpa_is_transformers_sdpa(model, fallbacks, monkeypatch):
    """Padded rows (a mask): the grouped call, logits to the bit and every gradient to rounding. Unpadded rows (no
    mask), masked calls longer than SHORT_KEYS, CPU autocast and FLOWKIT_KERNELS=reference: transformers' own call."""
    flowkit = copy.deepcopy(model)
    assert model.config._attn_implementation == "sdpa" and use_flowkit_sdpa(flowkit)
    assert flowkit.config._attn_implementation == FLOWKIT_SDPA and not use_flowkit_sdpa(flowkit)
    ids, mask = left_padded(5, 11)
    logits, grads = logits_and_grads(model, ids, mask)
    fallbacks.clear()
    flowkit_logits, flowkit_grads = logits_and_grads(flowkit, ids, mask)
    assert not fallbacks  # every layer took the grouped call
    assert torch.equal(flowkit_logits, logits)
    for name, grad in grads.items():
        torch.testing.assert_close(flowkit_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    logits_and_grads(flowkit, ids, torch.ones_like(mask))
    long_ids, long_mask = left_padded(2, SHORT_KEYS + 1)
    logits_and_grads(flowkit, long_ids, long_mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits_and_grads(flowkit, ids, mask)
    monkeypatch.setenv("FLOWKIT_KERNELS", "reference")
    logits_and_grads(flowkit, ids, mask)
    assert len(fallbacks) == 4 * model.config.num_hidden_layers


def test_the_shared_prompt_pass_and_decoding(fallbacks):
    """The training forward over a group's cached prompt (fewer queries than keys) gives transformers' sdpa hidden
    states to the bit; decoding (one query per row) runs transformers' own call."""
    model, _ = load_backbone("bundled:tiny_adder")
    assert model.config._attn_implementation == FLOWKIT_SDPA
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    torch.manual_seed(1)
    ids, mask = left_padded(6, 14, model.config.vocab_size)
    response = torch.zeros(ids.shape)
    response[:, 8:] = 1
    ids[:, :8] = ids[::2, :8].repeat_interleave(2, 0)  # two rows per prompt
    mask[:, :8] = mask[::2, :8].repeat_interleave(2, 0)
    batch = RolloutBatch(input_ids=ids, attention_mask=mask, response_mask=response,
                         group_ids=torch.arange(3).repeat_interleave(2))
    fallbacks.clear()
    hidden = forward_hidden_shared_prompts(model, batch)
    assert not fallbacks
    assert torch.equal(hidden, forward_hidden_shared_prompts(reference, batch))
    with torch.no_grad():
        cached = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        fallbacks.clear()
        model(input_ids=ids[:, -1:], attention_mask=mask,
              **{cache_argument(model.get_decoder()): cached.past_key_values})
    assert len(fallbacks) == model.config.num_hidden_layers
