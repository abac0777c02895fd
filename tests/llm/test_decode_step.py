"""flowkit's decoding step gives HF's logits bitwise, and steps aside wherever it could not."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
    Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

from flowkit.kernels import decode_attention
from flowkit.kernels.backends import native_has
from flowkit.kernels.cpu_linear import use_onednn_linears
from flowkit.llm import hf_engine
from flowkit.llm.decode_step import decode_step_for
from flowkit.llm.forward import position_ids
from flowkit.llm.fused_layers import use_fused_layers
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.kv_cache import prompt_cache
from flowkit.llm.tiny import char_tokenizer, tiny_qwen2

SIZE = {"vocab_size": 37, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
        "max_position_embeddings": 64, "pad_token_id": 0, "eos_token_id": 2}


def qwen2(heads=4, kv_heads=2, hidden=SIZE["hidden_size"]):
    return Qwen2ForCausalLM(Qwen2Config(**{**SIZE, "hidden_size": hidden}, num_attention_heads=heads,
                                        num_key_value_heads=kv_heads))


def qwen3():
    return Qwen3ForCausalLM(Qwen3Config(**SIZE, num_attention_heads=4, num_key_value_heads=2, head_dim=16))


def llama(heads=3, hidden=SIZE["hidden_size"]):  # no biases but the MLP's, RoPE rescaled as Llama 3's
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return LlamaForCausalLM(LlamaConfig(**{**SIZE, "hidden_size": hidden}, num_attention_heads=heads,
                                        num_key_value_heads=1, mlp_bias=True, rope_parameters=rope,
                                        tie_word_embeddings=False))


def mistral(sliding_window=None):
    return MistralForCausalLM(MistralConfig(**SIZE, num_attention_heads=4, num_key_value_heads=4,
                                            sliding_window=sliding_window))


MODELS = {"qwen2-gqa": qwen2, "qwen2-mha": lambda: qwen2(4, 4), "qwen3": qwen3, "llama3": llama, "mistral": mistral}


def prompts(rows: int, width: int, padded: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, SIZE["vocab_size"], (rows, width))
    mask = torch.ones_like(ids)
    for row in range(rows if padded else 0):
        mask[row, :row % 4] = 0
        ids[row, :row % 4] = 0
    return {"input_ids": ids, "attention_mask": mask}


def decode(model, encoded, tokens, mirrored: bool, drop_at: int) -> list[torch.Tensor]:
    """Each step's logits over ``tokens`` (steps × B) fed one per step after the prompts; after step ``drop_at``
    every other row leaves the batch and the cache, as finished rows do in the engine."""
    step = decode_step_for(model) if mirrored else None
    assert (step is not None) == mirrored
    width = encoded["input_ids"].shape[1]
    with torch.inference_mode():
        cache, pending = prompt_cache(model, encoded, 1, False, width + len(tokens) + 1)
        mask, positions = encoded["attention_mask"], position_ids(encoded["attention_mask"])
        out = [model(input_ids=pending, attention_mask=mask, position_ids=positions, use_cache=True,
                     logits_to_keep=1, cache=cache).logits[:, -1]]
        positions, rows = positions[:, -1:], torch.arange(len(mask))
        for index, column in enumerate(tokens):
            if index == drop_at:
                rows = rows[::2]
                cache.batch_select_indices(torch.arange(0, len(mask), 2))
                mask, positions = mask[::2], positions[::2]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            positions = positions + 1
            pending = column[rows, None]
            if mirrored:
                out.append(step(pending, mask, positions, cache))
            else:
                out.append(model(input_ids=pending, attention_mask=mask, position_ids=positions, use_cache=True,
                                 logits_to_keep=1, cache=cache).logits[:, -1])
    return out


@pytest.fixture
def sdpa_attention(monkeypatch):
    """The decoding attention's reference (SDPA as transformers calls it) wherever the native kernel would run."""
    monkeypatch.setattr(decode_attention, "backend_for", lambda query: "reference")


@pytest.mark.parametrize("architecture", MODELS)
@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_gives_hfs_logits_bitwise(architecture, padded, dtype, sdpa_attention):
    torch.manual_seed(0)
    model = MODELS[architecture]().to(dtype).eval()
    if architecture in ("qwen2-gqa", "qwen3"):  # the backbone loader's layers
        use_onednn_linears(model)
        assert use_fused_layers(model) == (2 * 3 + 1 if architecture == "qwen2-gqa" else 2 * 5 + 1)
    encoded = prompts(9, 7, padded)
    tokens = torch.randint(3, SIZE["vocab_size"], (12, 9))
    reference = decode(model, encoded, tokens, mirrored=False, drop_at=5)
    mirrored = decode(model, encoded, tokens, mirrored=True, drop_at=5)
    assert [logits.shape for logits in mirrored] == [logits.shape for logits in reference]
    assert all(torch.equal(a, b) for a, b in zip(mirrored, reference))


def test_under_bf16_autocast_the_step_gives_hfs_logits_bitwise():
    """float32 weights under CPU bf16 autocast (``trainer.precision: bf16-mixed``): the cache holds bf16 values, and
    every op, the native kernels' references included, takes autocast's dtypes as in HF's forward."""
    torch.manual_seed(0)
    model = qwen2(4, 2, hidden=128).eval()  # head dimension 32, which the native attention is compiled for
    use_onednn_linears(model)
    use_fused_layers(model)
    encoded = prompts(9, 7, padded=True)
    tokens = torch.randint(3, SIZE["vocab_size"], (6, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = decode(model, encoded, tokens, mirrored=False, drop_at=3)
        mirrored = decode(model, encoded, tokens, mirrored=True, drop_at=3)
    assert all(torch.equal(a, b) for a, b in zip(mirrored, reference))


@pytest.mark.skipif(not native_has("cpu", "decode_attention"), reason="flowkit._C without decode_attention")
@pytest.mark.parametrize("build", [lambda: qwen2(4, 2, hidden=128), lambda: llama(2, hidden=128)],
                         ids=["qwen2-gqa", "llama3-gqa"])
@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
def test_with_the_native_attention_the_logits_agree_to_rounding(build, padded):
    torch.manual_seed(0)
    model = build().eval()  # head dimensions 32 and 64, which the native kernel is compiled for
    encoded = prompts(9, 7, padded)
    tokens = torch.randint(3, SIZE["vocab_size"], (12, 9))
    assert decode_attention.backend_for(torch.zeros(1, 1, 1, 32)) == "native"
    reference = decode(model, encoded, tokens, mirrored=False, drop_at=5)
    mirrored = decode(model, encoded, tokens, mirrored=True, drop_at=5)
    for a, b in zip(mirrored, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not all(torch.equal(a, b) for a, b in zip(mirrored, reference))  # the native kernel did run


def test_the_step_steps_aside_where_it_would_not_be_hfs(monkeypatch):
    torch.manual_seed(0)
    assert decode_step_for(qwen2().eval()) is not None
    assert decode_step_for(qwen2().train()) is None
    eager = qwen2().eval()
    eager.config._attn_implementation = "eager"
    assert decode_step_for(eager) is None
    assert decode_step_for(mistral(sliding_window=8).eval()) is None
    assert decode_step_for(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=37)).eval()) is None
    hooked = qwen2().eval()
    handle = hooked.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert decode_step_for(hooked) is None
    handle.remove()
    assert decode_step_for(hooked) is not None

    class Adapted(torch.nn.Linear):  # as PEFT wraps a projection
        pass

    adapted = qwen2().eval()
    old = adapted.model.layers[0].self_attn.v_proj
    adapted.model.layers[0].self_attn.v_proj = Adapted(old.in_features, old.out_features)
    assert decode_step_for(adapted) is None
    monkeypatch.setenv("FLOWKIT_KERNELS", "reference")
    assert decode_step_for(qwen2().eval()) is None


def test_the_engine_samples_the_same_rollouts_through_either_forward(monkeypatch, sdpa_attention):
    tokenizer = char_tokenizer("0123456789+=")
    torch.manual_seed(1)
    model = tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=2, intermediate_size=64)
    use_onednn_linears(model)
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=10)
    question = ["1+2=", "13+27=", "5+5="]
    calls = []
    original = hf_engine.decode_step_for

    def recorded(model):
        step = original(model)
        calls.append(step is not None)
        return step

    monkeypatch.setattr(hf_engine, "decode_step_for", recorded)
    torch.manual_seed(2)
    mirrored = engine.generate(question, n=4)
    monkeypatch.setattr(hf_engine, "decode_step_for", lambda model: None)
    torch.manual_seed(2)
    reference = engine.generate(question, n=4)
    assert calls == [True]
    assert torch.equal(mirrored.input_ids, reference.input_ids)
    assert torch.equal(mirrored.rollout_logprobs, reference.rollout_logprobs)
