"""flowkit's sdpa: transformers' sdpa to the bit with the reference kernels, to rounding with the native one."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowkit.batch import RolloutBatch
from flowkit.kernels import short_attention
from flowkit.llm import sdpa
from flowkit.llm.backbone import load_backbone
from flowkit.llm.kv_cache import cache_argument, forward_hidden_shared_prompts
from flowkit.llm.sdpa import FLOWKIT_SDPA, use_flowkit_sdpa
from flowkit.llm.tiny import tiny_qwen2


def models():
    torch.manual_seed(0)
    yield tiny_qwen2(41, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)
    yield LlamaForCausalLM(LlamaConfig(vocab_size=41, hidden_size=192, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=6, num_key_value_heads=2))  # head dimension 32
    yield tiny_qwen2(41, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=96)  # no groups


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
def calls(monkeypatch):
    """Counts of the attention calls flowkit's sdpa hands to transformers' (``"sdpa"``) and to its kernel."""
    counts = {"sdpa": 0, "short_attention": 0}
    forward, kernel = sdpa.sdpa_attention_forward, sdpa.short_attention

    def counted(name, function):
        return lambda *args, **kwargs: counts.__setitem__(name, counts[name] + 1) or function(*args, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", counted("sdpa", forward))
    monkeypatch.setattr(sdpa, "short_attention", counted("short_attention", kernel))
    return counts


@pytest.mark.parametrize("model", models(), ids=["qwen2-gqa", "llama-gqa", "qwen2-mha"])
@pytest.mark.parametrize("kernels", ["reference", "native"])
def test_flowkit_sdpa_is_transformers_sdpa(model, kernels, calls, monkeypatch):
    """Reference kernels: logits and every gradient to the bit (SDPA with the KV heads unrepeated); native (where
    built): to float32 rounding. Padded rows (a mask) and unpadded ones (causal) alike."""
    if kernels == "native" and short_attention.backend_for(torch.randn(1, 1, 2, 32), torch.randn(1, 1, 3, 32)) \
            != "native":
        pytest.skip("flowkit._C without short_attention")
    if kernels == "reference":
        monkeypatch.setenv("FLOWKIT_KERNELS", "reference")
    flowkit = copy.deepcopy(model)
    assert model.config._attn_implementation == "sdpa" and use_flowkit_sdpa(flowkit)
    assert flowkit.config._attn_implementation == FLOWKIT_SDPA and not use_flowkit_sdpa(flowkit)
    ids, padding = left_padded(5, 11)
    for mask in (padding, torch.ones_like(padding)):
        logits, grads = logits_and_grads(model, ids, mask)
        calls.update(sdpa=0, short_attention=0)
        flowkit_logits, flowkit_grads = logits_and_grads(flowkit, ids, mask)
        assert calls == {"sdpa": 0, "short_attention": model.config.num_hidden_layers}
        if kernels == "reference":
            assert torch.equal(flowkit_logits, logits)
            for name, grad in grads.items():
                assert torch.equal(flowkit_grads[name], grad), name
        else:
            torch.testing.assert_close(flowkit_logits, logits, rtol=1e-5, atol=1e-5)
            for name, grad in grads.items():
                torch.testing.assert_close(flowkit_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_the_shared_prompt_pass_and_decoding(calls):
    """The training forward over a group's cached prompt (queries fewer than keys) equals transformers' sdpa to
    rounding (head dimension 32: the native kernel where built); decoding (one query per row) runs transformers' own call."""
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
    hidden = [forward_hidden_shared_prompts(m, batch) for m in (model, reference)]
    torch.testing.assert_close(hidden[0], hidden[1], rtol=1e-5, atol=1e-5)
    assert calls["short_attention"] == 2 * model.config.num_hidden_layers  # the prompts' pass and the responses'
    with torch.no_grad():
        cached = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        calls["sdpa"] = 0
        model(input_ids=ids[:, -1:], attention_mask=mask,
              **{cache_argument(model.get_decoder()): cached.past_key_values})
    assert calls["sdpa"] == model.config.num_hidden_layers
