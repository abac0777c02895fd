"""Chunked LM-head log-probs equal the full-vocabulary computation, in values and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flowkit.batch import RolloutBatch
from flowkit.llm.lora import LoraSettings, apply_lora
from flowkit.llm.forward import forward_hidden, forward_logits
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
    head = torch.nn.Linear(dim, vocab)
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
    grads = torch.autograd.grad((logprobs * weights).sum(), [hidden, head.weight, head.bias])
    expected_grads = torch.autograd.grad((expected * weights).sum(), [hidden, head.weight, head.bias])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kept_logits_serve_one_backward_and_a_second_recomputes():
    """``chunk_size`` None keeps the forward's logits for the backward and uses them up in place; a second backward
    through the same graph (``retain_graph``) recomputes them and gives the same gradients."""
    generator = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(3, 9, 16, generator=generator, requires_grad=True)
    batch = batch_with_responses(50, generator)
    logprobs, _ = lm_head_logprobs(hidden, head, batch.input_ids, batch.response_mask, temperature=0.7, chunk_size=None)
    weights = torch.randn(3, 9, generator=generator)
    expected = token_logprobs(head(hidden), batch.input_ids, 0.7) * batch.response_mask
    want = torch.autograd.grad((expected * weights).sum(), [hidden, head.weight])
    first = torch.autograd.grad((logprobs * weights).sum(), [hidden, head.weight], retain_graph=True)
    second = torch.autograd.grad((logprobs * weights).sum(), [hidden, head.weight])
    for one, two, reference in zip(first, second, want):
        torch.testing.assert_close(one, reference, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(two, reference, rtol=1e-5, atol=1e-6)


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


def test_a_frozen_head_gives_the_full_logits_logprobs_and_hidden_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(6, 11).requires_grad_(False)
    hidden = torch.randn(2, 5, 6, requires_grad=True)
    ids, mask = torch.randint(0, 11, (2, 5)), torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]).float()
    expected = token_logprobs(head(hidden), ids, 0.7) * mask
    weights = torch.randn_like(expected)
    (reference,) = torch.autograd.grad((expected * weights).sum(), hidden)
    got, entropy = lm_head_logprobs(hidden, head, ids, mask, temperature=0.7, chunk_size=2)  # 6 tokens: 3 chunks
    torch.testing.assert_close(got, expected)
    assert not entropy.requires_grad
    (grad,) = torch.autograd.grad((got * weights).sum(), hidden)
    torch.testing.assert_close(grad, reference)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_bf16_autocast_computes_as_the_module_does(frozen):
    """Under bf16 autocast (``bf16-mixed`` over fp32 weights) the head's matmuls run in bf16 as the module's own
    forward does: log-probs and gradients agree with the checkpointed module path within bf16 rounding."""
    from flowkit.rl.logprobs import _module_head_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50).requires_grad_(not frozen)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    ids, mask = torch.randint(0, 50, (2, 9)), torch.ones(2, 9)
    trainable = [hidden] + ([] if frozen else [head.weight, head.bias])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = lm_head_logprobs(hidden, head, ids, mask, chunk_size=4)
        states, targets = hidden[:, :-1].reshape(-1, 16), ids[:, 1:].reshape(-1)
        want, _ = _module_head_logprobs(head, hidden, ids, states, targets, 1.0, 4, False)
    torch.testing.assert_close(got[:, 1:].reshape(-1), want)
    for mine, theirs in zip(torch.autograd.grad(got.sum(), trainable), torch.autograd.grad(want.sum(), trainable)):
        torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("chunk_size", [2, None], ids=["chunked", "kept"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_entropy_gradient_matches_full_logits(frozen, chunk_size):
    """``entropy_gradient``: the entropies carry the gradient of token_entropy(full logits), through the analytic
    backward (∂H/∂z = −p ⊙ (log p + H)), to the hidden states and a trained head, from recomputed chunks or from the
    logits the forward kept."""
    torch.manual_seed(1)
    head = torch.nn.Linear(6, 11).requires_grad_(not frozen)
    hidden = torch.randn(2, 5, 6, requires_grad=True)
    ids, mask = torch.randint(0, 11, (2, 5)), torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]).float()
    weights, entropy_weights = torch.randn(2, 5), torch.randn(2, 5)
    trainable = [hidden] + ([] if frozen else [head.weight, head.bias])
    logits = head(hidden)
    full = (token_logprobs(logits, ids, 0.7) * weights + token_entropy(logits, 0.7) * entropy_weights) * mask
    reference = torch.autograd.grad(full.sum(), trainable)
    got, entropy = lm_head_logprobs(hidden, head, ids, mask, temperature=0.7, chunk_size=chunk_size,
                                    entropy_gradient=True)
    assert entropy.requires_grad
    grads = torch.autograd.grad((got * weights + entropy * entropy_weights).sum(), trainable)
    for mine, theirs in zip(grads, reference):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["trained", "frozen"])
def test_zero3_gathers_the_head_once_per_micro_batch(head):
    """2 CPU ranks under ZeRO-3 (tests/rl/zero3_lm_head_job.py), micro-batches of 2-8 chunks whose count changes
    every step, as RL's do: once the first step has recorded DeepSpeed's module trace, the head is all-gathered at
    most twice per micro-batch (forward; backward with its recomputation) — per-chunk calls gathered it 12-26 times
    — with the full logits' log-probs and, for a trained head, the ranks' mean of its full-logits gradient."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("deepspeed")
    job = Path(__file__).with_name("zero3_lm_head_job.py")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(job), head], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    assert len(lines) == 1, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = json.loads(lines[0].removeprefix("RESULTS "))
    assert [rank["rank"] for rank in ranks] == [0, 1], ranks
    for rank in ranks:
        assert all(count <= 2 for count in rank["gathers"][1:]), rank
        assert rank["loss_close"] and rank.get("head_grad_close", True), rank
