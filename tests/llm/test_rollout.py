"""HF rollouts sample from the policy's own tempered softmax, whatever the model's generation_config says."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.tiny import char_tokenizer, tiny_qwen2


@pytest.mark.parametrize("wrap", ["plain", "peft"])
def test_sampling_ignores_generation_defaults_that_reshape_the_distribution(wrap):
    """A fresh model's next-token distribution is near uniform over ~250 tokens, so 400 samples of one token hit
    ~200 distinct ones. The model's generation_config asks for top_k 1 (one token) and HF's global default is
    top_k 50 (at most 50): the loss scores rollouts under the full softmax, so neither may apply. The model's
    config is restored afterwards."""
    alphabet = [chr(0x4E00 + i) for i in range(252)]
    tokenizer = char_tokenizer(alphabet, add_bos=True)
    torch.manual_seed(0)
    model = tiny_qwen2(len(tokenizer))
    model.generation_config.top_k, model.generation_config.repetition_penalty = 1, 1.3
    if wrap == "peft":
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=1, temperature=1.0)
    sampled = engine.generate([alphabet[0]], n=400).input_ids[:, -1]
    assert sampled.unique().numel() > 100
    config = model.get_base_model().generation_config if wrap == "peft" else model.generation_config
    assert (config.top_k, config.repetition_penalty) == (1, 1.3)


PROMPTS = ["3+4=", "68+62=", "7+15="]  # left-padded to unequal lengths


def _hf_generate(model, tokenizer, n: int, max_new_tokens: int, **sampling):
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    output = model.generate(**encoded, max_new_tokens=max_new_tokens, num_return_sequences=n, top_k=0,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **sampling)
    width = encoded["input_ids"].shape[1]
    return output[:, width:], width


def test_sample_from_draws_each_token_with_its_probability():
    """The inverse-CDF draw against the categorical distribution (a shift by one index, a float32 sum or a wrong
    bound would show): 60k draws per row match the probabilities within 4.5 standard errors, tokens of probability 0
    (the nucleus's cut, the first and last vocabulary entries) are never drawn, and a row with all its mass on the
    last token always draws it."""
    from flowkit.llm.hf_engine import sample_from

    probs = torch.tensor([[0.0, 0.5, 0.25, 0.0, 0.125, 0.0625, 0.0625, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                          [0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.7]])
    torch.manual_seed(0)
    draws = torch.stack([sample_from(probs) for _ in range(60_000)])  # draws × rows
    counts = torch.stack([torch.bincount(draws[:, row], minlength=8) for row in range(3)]).double()
    frequency = counts / len(draws)
    standard_error = (probs.double() * (1 - probs.double()) / len(draws)).sqrt()
    assert ((frequency - probs.double()).abs() <= 4.5 * standard_error + 1e-12).all(), frequency
    assert (counts[probs == 0] == 0).all() and (counts[1, 7] == len(draws))


def test_first_tokens_follow_the_policy_distribution_and_prompts_are_encoded_once_per_group():
    """2,000 samples of the first response token per prompt against the bundled policy's own next-token softmax
    (total variation under 0.06; ~0.03 is the sampling noise of 2,000 draws over the tokens it favours), with each
    prompt's ids repeated per sample as HF tokenizes them; the sampler's log-probs are the softmax's at the drawn
    token."""
    from flowkit.llm.backbone import load_backbone

    model, tokenizer = load_backbone("bundled:tiny_adder", "float32", False)
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=1, temperature=1.0)
    torch.manual_seed(5)
    batch = engine.generate(PROMPTS, n=2000)
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    width = encoded["input_ids"].shape[1]
    assert torch.equal(batch.input_ids[:, :width], encoded["input_ids"].repeat_interleave(2000, 0))
    with torch.no_grad():
        probs = torch.softmax(model(**encoded).logits[:, -1].float(), -1)
    first = batch.input_ids[:, width].reshape(len(PROMPTS), 2000)
    for row, drawn in enumerate(first):
        frequency = torch.bincount(drawn, minlength=probs.shape[-1]) / len(drawn)
        assert 0.5 * float((frequency - probs[row]).abs().sum()) < 0.06
    logprobs = batch.rollout_logprobs[:, width].reshape(len(PROMPTS), 2000)
    assert torch.allclose(logprobs, probs.log().gather(-1, first), atol=1e-5)


@pytest.mark.parametrize("synced", [False, True])
def test_greedy_rollouts_equal_hf_generate_with_rows_ending_at_different_steps(synced, monkeypatch):
    """Greedy decoding is deterministic, so rows that leave the batch when they end must still complete as HF
    ``generate`` completes them, whole sequences, EOS and padding included. ``synced`` (ZeRO-3 without whole
    weights; one rank here): finished rows stay in the batch until every rank's rows have ended — same result."""
    from flowkit.llm import hf_engine
    from flowkit.llm.backbone import load_backbone

    model, tokenizer = load_backbone("bundled:tiny_adder", "float32", False)
    monkeypatch.setattr(hf_engine, "_zero3_partitioned", lambda model: synced)
    batch = HFRolloutEngine(model, tokenizer, max_new_tokens=40).generate(PROMPTS, n=1, temperature=0)
    expected, width = _hf_generate(model, tokenizer, 1, 40, do_sample=False)
    lengths = batch.response_mask.sum(-1)
    assert len(set(lengths.tolist())) > 1  # the rows end at different steps
    assert torch.equal(batch.input_ids[:, width:], expected)
    assert batch.responses == tokenizer.batch_decode(expected, skip_special_tokens=True)


def test_reserved_kv_layer_holds_what_a_dynamic_layer_holds():
    """The decoding cache writes into positions reserved up front; after a prefill, a repeat per sample, steps and
    dropped rows it holds exactly what transformers' concatenating ``DynamicLayer`` holds, and it refuses to run past
    its reservation."""
    from transformers.cache_utils import DynamicLayer

    from flowkit.llm.kv_cache import ReservedLayer

    torch.manual_seed(0)
    reserved, dynamic = ReservedLayer(capacity=7), DynamicLayer()
    steps = [lambda layer: layer.update(torch.randn(3, 2, 4, 5), torch.randn(3, 2, 4, 5)),
             lambda layer: layer.batch_repeat_interleave(2),
             lambda layer: layer.update(torch.randn(6, 2, 1, 5), torch.randn(6, 2, 1, 5)),
             lambda layer: layer.batch_select_indices(torch.tensor([0, 2, 5])),
             lambda layer: layer.update(torch.randn(3, 2, 2, 5), torch.randn(3, 2, 2, 5))]
    for step in steps:
        state = torch.get_rng_state()
        step(dynamic)
        torch.set_rng_state(state)  # the same random states for both layers
        step(reserved)
        assert torch.equal(reserved.keys, dynamic.keys) and torch.equal(reserved.values, dynamic.values)
        assert reserved.get_seq_length() == dynamic.get_seq_length()
    assert reserved.get_seq_length() == 7
    with pytest.raises(RuntimeError, match="reserved for 7 positions"):
        reserved.update(torch.randn(3, 2, 1, 5), torch.randn(3, 2, 1, 5))


@pytest.mark.parametrize("n", [1, 3])
def test_rollouts_that_fill_the_token_budget_equal_hf_generate(n):
    """Every row decodes to ``max_new_tokens`` (the cache's last reserved position), with each prompt encoded per
    row (n = 1) or once per group (n = 3); the ids are plain tensors that autograd may use (decoding runs in
    inference mode)."""
    from flowkit.llm.backbone import load_backbone

    model, tokenizer = load_backbone("bundled:tiny_adder", "float32", False)
    batch = HFRolloutEngine(model, tokenizer, max_new_tokens=3).generate(PROMPTS, n=n, temperature=0)
    expected, width = _hf_generate(model, tokenizer, 1, 3, do_sample=False)  # HF: no greedy num_return_sequences
    assert (batch.response_mask.sum(-1) == 3).all()
    assert torch.equal(batch.input_ids[:, width:], expected.repeat_interleave(n, dim=0))
    assert not batch.input_ids.is_inference()
    model.get_input_embeddings()(batch.input_ids).sum().backward()


def test_cached_expert_latents_equal_a_fresh_encoding():
    """Pairs seen in other batches (other padding) come back as :func:`expert_latents` encodes them now: equal on
    every real token, in the same layout, with the same response mask."""
    from flowkit.llm.backbone import load_backbone
    from flowkit.llm.latent_tap import LatentTap
    from flowkit.rewards.flow.expert_latents import ExpertLatentCache, expert_latents

    model, tokenizer = load_backbone("bundled:tiny_adder", "float32", False)
    tap = LatentTap(model, [0.25, 0.75])
    pairs = [("3+4=", "3+4=7\\boxed{7}"), ("68+62=", "8+2=10,6+6+1=13\\boxed{130}"), ("7+15=", "7+5=12\\boxed{22}")]
    cache = ExpertLatentCache(model, tokenizer, tap, torch.device("cpu"))
    cache([pairs[0][0], pairs[2][0]], [pairs[0][1], pairs[2][1]])  # encoded in a batch of other widths
    prompts, solutions = [p for p, _ in pairs[::-1]], [s for _, s in pairs[::-1]]
    latents, mask = cache(prompts, solutions)
    fresh, fresh_mask = expert_latents(model, tokenizer, tap, prompts, solutions, torch.device("cpu"))
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")["attention_mask"]
    real = torch.cat([encoded.bool(), fresh_mask[:, encoded.shape[1]:].bool()], dim=1)
    assert torch.equal(mask, fresh_mask) and latents.shape == fresh.shape
    torch.testing.assert_close(latents[:, real], fresh[:, real], rtol=1e-5, atol=1e-5)
    assert latents[:, ~real].abs().max() == 0 and len(cache.rows) == 3


@pytest.mark.parametrize("zero3", [False, True])
def test_expert_latents_run_the_decoder_only_as_far_as_the_deepest_tap(zero3):
    """Blocks after the deepest tapped one and the LM head do not run, except under ZeRO-3 (parameters marked with
    ``ds_id``), where every forward must visit every module; the latents are the same either way."""
    from flowkit.llm.backbone import load_backbone
    from flowkit.llm.latent_tap import LatentTap
    from flowkit.rewards.flow.expert_latents import expert_latents
    from flowkit.llm.packing import encode_pairs

    model, tokenizer = load_backbone("bundled:tiny_adder", "float32", False)
    tap = LatentTap(model, [0.25])  # block 1 of 4
    prompts, solutions = ["3+4=", "68+62="], ["3+4=7\\boxed{7}", "8+2=10,6+6+1=13\\boxed{130}"]
    full = encode_pairs(tokenizer, prompts, solutions)
    with torch.no_grad(), tap:
        model(input_ids=full.input_ids, attention_mask=full.attention_mask,
              position_ids=(full.attention_mask.cumsum(-1) - 1).clamp(min=0))
    expected = tap.latents
    if zero3:
        model.lm_head.weight.ds_id = 0
    ran = []
    hooks = [module.register_forward_hook(lambda m, i, o, name=name: ran.append(name))
             for name, module in [("block 2", model.model.layers[2]), ("lm head", model.lm_head)]]
    latents, _ = expert_latents(model, tokenizer, tap, prompts, solutions, torch.device("cpu"))
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(latents, expected)
    assert ran == (["block 2"] if zero3 else [])
