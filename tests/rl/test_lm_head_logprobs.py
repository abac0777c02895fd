"""Chunked LM-head log-probs equal the full-vocabulary computation, in values and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flowkit.batch import RolloutBatch
from flowkit.llm.lora import LoraSettings, apply_lora
from flowkit.llm.rollout import forward_hidden, forward_logits
from flowkit.rl.logprobs import lm_head_logprobs, token_entropy, token_logprobs


def batch_with_responses(vocab: int, generator: torch.Generator) -> RolloutBatch:
    """3 rows, left-padded prompts and right-padded responses of different lengths (one empty)."""
    input_ids = torch.randint(3, vocab, (3, 9), generator=generator)
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0, 0, 0]])
    response = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1], [0] * 9], dtype=torch.float32)
    return RolloutBatch(input_ids=input_ids, attention_mask=attention, response_mask=response,
                        group_ids=torch.arange(3))


@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_matches_full_logits_in_values_and_gradients(chunk_size):
    generator = torch.Generator().manual_seed(0)
    vocab, dim = 50, 16
    head = torch.nn.Linear(dim, vocab, bias=False)
    hidden = torch.randn(3, 9, dim, generator=generator, requires_grad=True)
    batch = batch_with_responses(vocab, generator)
    mask = batch.response_mask

    logprobs, entropy = lm_head_logprobs(hidden, head, batch.input_ids, mask, temperature=0.7, chunk_size=chunk_size)
    logits = head(hidden)
    expected = token_logprobs(logits, batch.input_ids, 0.7) * mask
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy, token_entropy(logits, 0.7) * mask, rtol=1e-5, atol=1e-6)
    assert not entropy.requires_grad

    weights = torch.randn(3, 9, generator=generator)
    grads = torch.autograd.grad((logprobs * weights).sum(), [hidden, head.weight])
    expected_grads = torch.autograd.grad((expected * weights).sum(), [hidden, head.weight])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_no_grad_mode_and_empty_responses():
    head = torch.nn.Linear(4, 7, bias=False)
    hidden = torch.randn(2, 5, 4)
    mask = torch.zeros(2, 5)
    with torch.no_grad():
        logprobs, entropy = lm_head_logprobs(hidden, head, torch.zeros(2, 5, dtype=torch.long), mask)
    assert torch.equal(logprobs, torch.zeros(2, 5)) and torch.equal(entropy, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="chunk_size"):
        lm_head_logprobs(hidden, head, torch.zeros(2, 5, dtype=torch.long), mask, chunk_size=0)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tied_embeddings_and_lora_through_the_decoder(lora):
    """forward_hidden + the output-embedding module give the model's own logits' log-probs, with the gradients
    of every trainable parameter (the head's weight is the tied input embedding)."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if lora:
        model = apply_lora(model, LoraSettings(r=4, alpha=8))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)  # non-zero adapters, so they change the logits
    batch = batch_with_responses(40, torch.Generator().manual_seed(1))
    trainable = [p for p in model.parameters() if p.requires_grad]

    logprobs, _ = lm_head_logprobs(forward_hidden(model, batch), model.get_output_embeddings(), batch.input_ids,
                                   batch.response_mask, chunk_size=3)
    expected = token_logprobs(forward_logits(model, batch), batch.input_ids) * batch.response_mask
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(logprobs.sum(), trainable)
    expected_grads = torch.autograd.grad(expected.sum(), trainable)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_frozen_sharded_head_gives_the_same_logprobs_and_hidden_gradients(monkeypatch):
    """The frozen ZeRO-3 head's path (weights gathered explicitly, analytic backward) equals the checkpointed module
    call on log-probs and on the gradient w.r.t. the hidden states."""
    import flowkit.rl.logprobs as logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(6, 11).requires_grad_(False)
    hidden = torch.randn(2, 5, 6, requires_grad=True)
    ids, mask = torch.randint(0, 11, (2, 5)), torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]).float()
    expected, _ = lm_head_logprobs(hidden, head, ids, mask, temperature=0.7, chunk_size=2)
    weights = torch.randn_like(expected)
    (reference,) = torch.autograd.grad((expected * weights).sum(), hidden)
    monkeypatch.setattr(logprobs, "zero3_sharded", lambda params: True)  # as if DeepSpeed had sharded the head
    calls, apply = [], logprobs._FrozenHeadChunk.apply
    monkeypatch.setattr(logprobs._FrozenHeadChunk, "apply", lambda *args: calls.append(1) or apply(*args))
    got, entropy = lm_head_logprobs(hidden, head, ids, mask, temperature=0.7, chunk_size=2)
    assert len(calls) == 3  # 6 response tokens (position 0 excluded) in chunks of 2
    torch.testing.assert_close(got, expected)
    assert not entropy.requires_grad
    (grad,) = torch.autograd.grad((got * weights).sum(), hidden)
    torch.testing.assert_close(grad, reference)


def test_entropy_gradient_matches_full_logits_also_through_a_frozen_sharded_head(monkeypatch):
    """``entropy_gradient``: the entropies carry the gradient of token_entropy(full logits), through the checkpointed
    chunks and through the frozen ZeRO-3 head's analytic backward (∂H/∂z = −p ⊙ (log p + H))."""
    import flowkit.rl.logprobs as logprobs

    torch.manual_seed(1)
    head = torch.nn.Linear(6, 11).requires_grad_(False)
    hidden = torch.randn(2, 5, 6, requires_grad=True)
    ids, mask = torch.randint(0, 11, (2, 5)), torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]).float()
    weights, entropy_weights = torch.randn(2, 5), torch.randn(2, 5)
    logits = head(hidden)
    full = (token_logprobs(logits, ids, 0.7) * weights + token_entropy(logits, 0.7) * entropy_weights) * mask
    (reference,) = torch.autograd.grad(full.sum(), hidden)
    for sharded in (False, True):
        monkeypatch.setattr(logprobs, "zero3_sharded", lambda params, sharded=sharded: sharded)
        got, entropy = lm_head_logprobs(hidden, head, ids, mask, temperature=0.7, chunk_size=2, entropy_gradient=True)
        assert entropy.requires_grad
        (grad,) = torch.autograd.grad((got * weights + entropy * entropy_weights).sum(), hidden)
        torch.testing.assert_close(grad, reference, msg=f"sharded={sharded}")
