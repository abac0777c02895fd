"""flowkit's grouped sdpa: transformers' sdpa outputs and gradients to the bit, without repeating the KV heads."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowkit.batch import RolloutBatch
from flowkit.llm import grouped_sdpa
from flowkit.llm.backbone import load_backbone
from flowkit.llm.grouped_sdpa import GROUPED_SDPA, use_grouped_sdpa
from flowkit.llm.kv_cache import forward_hidden_shared_prompts
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


@pytest.mark.parametrize("model", models(), ids=["qwen2", "llama"])
def test_grouped_sdpa_is_sdpa_to_the_bit(model, monkeypatch):
    grouped = copy.deepcopy(model)
    assert model.config._attn_implementation == "sdpa" and use_grouped_sdpa(grouped)
    assert grouped.config._attn_implementation == GROUPED_SDPA and not use_grouped_sdpa(grouped)
    fallbacks = []
    forward = grouped_sdpa.sdpa_attention_forward
    monkeypatch.setattr(grouped_sdpa, "sdpa_attention_forward", lambda *a, **k: fallbacks.append(1) or forward(*a, **k))
    ids, mask = left_padded(5, 11)
    logits, grads = logits_and_grads(model, ids, mask)
    grouped_logits, grouped_grads = logits_and_grads(grouped, ids, mask)
    assert not fallbacks  # every layer took the grouped call
    assert torch.equal(grouped_logits, logits)
    for name, grad in grads.items():
        assert torch.equal(grouped_grads[name], grad), name
    logits_and_grads(grouped, ids, torch.ones_like(mask))  # no padding: no mask, transformers' own call
    assert len(fallbacks) == model.config.num_hidden_layers


def test_the_shared_prompt_pass_and_decoding_are_unchanged(monkeypatch):
    """The training forward over a group's cached prompt (query shorter than the keys) equals sdpa's; decoding (one
    query per row) runs transformers' own call."""
    model, _ = load_backbone("bundled:tiny_adder")
    assert model.config._attn_implementation == GROUPED_SDPA
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    torch.manual_seed(1)
    ids, mask = left_padded(6, 14, model.config.vocab_size)
    response = torch.zeros_like(mask)
    response[:, 8:] = 1
    ids[:, :8] = ids[::2, :8].repeat_interleave(2, 0)  # two rows per prompt
    mask[:, :8] = mask[::2, :8].repeat_interleave(2, 0)
    batch = RolloutBatch(input_ids=ids, attention_mask=mask, response_mask=response.float(),
                         group_ids=torch.arange(3).repeat_interleave(2))
    hidden = [forward_hidden_shared_prompts(m, batch) for m in (model, reference)]
    assert torch.equal(hidden[0], hidden[1])
    fallbacks = []
    forward = grouped_sdpa.sdpa_attention_forward
    monkeypatch.setattr(grouped_sdpa, "sdpa_attention_forward", lambda *a, **k: fallbacks.append(1) or forward(*a, **k))
    with torch.no_grad():
        cached = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        fallbacks.clear()
        model(input_ids=ids[:, -1:], attention_mask=mask, past_key_values=cached.past_key_values)
    assert len(fallbacks) == model.config.num_hidden_layers
