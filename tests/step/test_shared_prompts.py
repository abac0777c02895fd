"""The training forward running each group's prompt once gives the row-by-row forward's log-probs, entropies, values
and gradients, and steps aside where it would be unsound."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from flowkit.batch import RolloutBatch
from flowkit.step import actor as actor_module
from flowkit.step.actor import Actor
from flowkit.step.options import LossOptions, UpdateOptions
from flowkit.llm.backbone import load_backbone
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.kv_cache import forward_hidden_shared_prompts


def sampled_rows(model, tokenizer) -> RolloutBatch:
    """3 prompts of unequal length (left padding differs) × 4 samples, two decoding calls (widths differ) joined."""
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=24, rollout_batch_size=8)
    torch.manual_seed(0)
    return engine.generate(["3+4=", "68+62=", "7+15="], n=4)


def forward_and_gradients(actor: Actor, batch: RolloutBatch, policy) -> tuple[list, dict]:
    out = actor.forward(batch)
    values = out.values if out.values is not None else torch.zeros(())
    ((out.logprobs * batch.response_mask).sum() + (out.entropy * batch.response_mask).sum() + values.sum()).backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad()
    if actor.value_head is not None:
        grads |= {f"value.{name}": p.grad.clone() for name, p in actor.value_head.named_parameters()}
        actor.value_head.zero_grad()
    masked = [t * batch.response_mask for t in (out.logprobs, out.entropy, values)]
    return masked, grads


@pytest.mark.parametrize("wrap", ["plain", "lora"])
def test_shared_prompt_forward_equals_row_by_row(wrap, monkeypatch):
    model, tokenizer = load_backbone("bundled:tiny_adder", "float32", False)
    batch = sampled_rows(model, tokenizer)
    if wrap == "lora":
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    torch.manual_seed(1)
    value_head = torch.nn.Linear(model.config.hidden_size, 1)
    options = UpdateOptions(lm_head_chunk_size=7)
    actor = Actor(model, None, value_head, None, options, LossOptions(entropy_coef=0.1))
    calls = []
    monkeypatch.setattr(actor_module, "forward_hidden_shared_prompts",
                        lambda *a: calls.append(1) or forward_hidden_shared_prompts(*a))
    batch = batch.select(torch.tensor([0, 5, 1, 9, 4, 11, 8]))  # groups split and interleaved, one row of group 2 alone
    shared, shared_grads = forward_and_gradients(actor, batch, model)
    assert calls and forward_hidden_shared_prompts(model, batch) is not None
    monkeypatch.setattr(actor_module, "forward_hidden_shared_prompts", lambda *a: None)
    expected, expected_grads = forward_and_gradients(actor, batch, model)
    for ours, theirs in zip(shared, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert shared_grads.keys() == expected_grads.keys() and len(expected_grads) > 2
    for name, grad in expected_grads.items():  # fp32 sums in another order: tolerance on each tensor's scale
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-3, atol=1e-5 * max(1.0, grad.abs().max()),
                                   msg=name)


def test_shared_prompts_step_aside_where_unsound(monkeypatch):
    """No two rows of a group, a group whose rows were encoded apart, activation checkpointing: row by row."""
    model, tokenizer = load_backbone("bundled:tiny_adder", "float32", False)
    batch = sampled_rows(model, tokenizer)
    assert forward_hidden_shared_prompts(model, batch.select(torch.tensor([0, 4, 8]))) is None  # one row per group
    moved = batch.select(torch.tensor([0, 1]))
    moved.input_ids[1, 0] = tokenizer.pad_token_id + 3  # the two rows' prompt columns now differ
    assert forward_hidden_shared_prompts(model, moved) is None
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()  # as PolicyModule
    actor = Actor(model, None, None, None, UpdateOptions(), LossOptions())
    called = []
    monkeypatch.setattr(actor_module, "forward_hidden_shared_prompts",
                        lambda *a: called.append(1) or forward_hidden_shared_prompts(*a))
    actor.forward(batch)
    assert not called
