"""Padding-free passes (``update.padding_free``): the rows packed into one sequence give the padded pass's log-probs,
entropies, values, gradients, latents, flow rewards and KL-reference log-probs — fp32 to 1e-5 (absolute; the sums
run in another order), bf16 to 0.1 nats (bf16 keeps 8 bits of mantissa through 4 layers) — on odd lengths, rows of
one token, one row, prompts of different lengths, and beside the shared-prompt pass; micro-batches pack real tokens
to the budget; the step logs ``perf/padding_frac``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flowkit.batch import RolloutBatch
from flowkit.llm.backbone import load_backbone
from flowkit.llm.sdpa import SDPA_IMPLEMENTATIONS
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.kv_cache import forward_hidden_shared_prompts
from flowkit.llm.latent_tap import LatentTap
from flowkit.llm import padding_free
from flowkit.llm.padding_free import PackedRows, packs_rows
from flowkit.rewards.flow.reward import FlowReward
from flowkit.step import actor as actor_module
from flowkit.step.actor import Actor, KLReference
from flowkit.step.micro_batches import micro_batch_rows, pack_by_token_budget
from flowkit.step.options import LossOptions, UpdateOptions

TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 0.1, "rtol": 0.05}}


@pytest.fixture(scope="module")
def rows() -> RolloutBatch:
    """3 prompts of unequal length (left padding differs) × 4 samples of odd lengths; row 2 cut to a one-token
    response and row 7 to its first prompt token alone (no response)."""
    model, tokenizer = load_backbone("bundled:tiny_adder", "float32", False)
    torch.manual_seed(0)
    batch = HFRolloutEngine(model, tokenizer, max_new_tokens=13, rollout_batch_size=12).generate(
        ["3+4=", "68+62=", "7+15="], n=4)
    first_response = int(batch.response_mask[2].nonzero()[0])
    batch.attention_mask[2, first_response + 1:] = 0
    batch.response_mask[2, first_response + 1:] = 0
    first_token = int(batch.attention_mask[7].nonzero()[0])
    batch.attention_mask[7, first_token + 1:] = 0
    batch.response_mask[7] = 0
    return batch


def policy(dtype: torch.dtype, attention: str = "sdpa", lora: bool = False) -> torch.nn.Module:
    model, _ = load_backbone("bundled:tiny_adder", dtype, False)
    model.config._attn_implementation = attention
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    return model


def outputs(actor: Actor, batch: RolloutBatch) -> tuple[dict, dict]:
    """Log-probs, entropies and values on response tokens, latents on real tokens, and every gradient."""
    out = actor.forward(batch, tap=actor.tap is not None)
    mask = batch.response_mask
    ((out.logprobs * mask).sum() + (out.entropy * mask).sum() + out.values.sum()).backward()
    grads = {name: p.grad.clone() for name, p in actor.policy.named_parameters() if p.grad is not None}
    grads |= {f"value.{name}": p.grad.clone() for name, p in actor.value_head.named_parameters()}
    actor.policy.zero_grad()
    actor.value_head.zero_grad()
    values = {"logprobs": out.logprobs * mask, "entropy": out.entropy * mask, "values": out.values}
    if out.latents is not None:
        values["latents"] = out.latents * batch.attention_mask[None, :, :, None]
    return values, grads


def actors(model: torch.nn.Module, tap: LatentTap | None = None) -> tuple[Actor, Actor]:
    """The padded and the packed actor on one model (and one value head)."""
    torch.manual_seed(1)
    value_head = torch.nn.Linear(model.config.hidden_size, 1).to(model.dtype)
    update = UpdateOptions(lm_head_chunk_size=7)
    return tuple(Actor(model, tap, value_head, None, replace(update, padding_free=free), LossOptions(entropy_coef=0.1))
                 for free in (False, True))


def assert_equal_passes(padded: Actor, packed: Actor, batch: RolloutBatch, dtype: torch.dtype) -> None:
    expected, expected_grads = outputs(padded, batch)
    ours, our_grads = outputs(packed, batch)
    assert expected.keys() == ours.keys()
    for name, value in expected.items():
        torch.testing.assert_close(ours[name].float(), value.float(), **TOLERANCE[dtype], msg=name)
    assert our_grads.keys() == expected_grads.keys() and len(expected_grads) > 2
    grad_tolerance = {"atol": 1e-4, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 0.5, "rtol": 0.2}
    for name, grad in expected_grads.items():
        torch.testing.assert_close(our_grads[name].float(), grad.float(), **grad_tolerance, msg=name)


SUBSETS = {"all": list(range(12)), "one row": [5], "one-token rows": [2, 7, 10], "odd": [11, 0, 6, 3, 9]}


@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("attention", [*SDPA_IMPLEMENTATIONS, "eager"])
def test_packed_pass_equals_padded_fp32(rows, subset, attention):
    model = policy(torch.float32, attention)
    assert packs_rows(model)
    padded, packed = actors(model)
    assert_equal_passes(padded, packed, rows.select(SUBSETS[subset]).trimmed(), torch.float32)


def test_packed_pass_equals_padded_bf16(rows):
    model = policy(torch.bfloat16)
    padded, packed = actors(model)
    assert_equal_passes(padded, packed, rows, torch.bfloat16)


@pytest.mark.parametrize("lora", [False, True])
def test_packed_latents_and_flow_rewards_equal_padded(rows, lora):
    """A tapped policy's latents (B×S, as the reward model reads them) and the flow reward they score."""
    model = policy(torch.float32, lora=lora)
    tap = LatentTap(model, [0.25, 0.5, 0.75])
    padded, packed = actors(model, tap)
    assert_equal_passes(padded, packed, rows, torch.float32)
    reward = FlowReward()
    reward.bind(model, tap.layer_positions)
    rewards = []
    for actor in (padded, packed):
        scored = replace(rows, latents=actor.forward(rows, tap=True).latents)
        rewards.append(reward.token_rewards(scored, step=3))
    assert rewards[0].abs().sum() > 0
    torch.testing.assert_close(rewards[1], rewards[0], **TOLERANCE[torch.float32])


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("attention", SDPA_IMPLEMENTATIONS)
def test_sdpa_runs_row_by_row_except_under_activation_checkpointing(rows, checkpointing, attention, monkeypatch):
    """``sdpa`` (transformers' or flowkit's grouped one) attends row by row (no T×T mask); under activation
    checkpointing, whose recomputation runs after the forward, transformers' block-causal mask instead. Both give the
    padded pass's outputs and gradients."""
    model = policy(torch.float32, attention)
    if checkpointing:
        model.gradient_checkpointing_enable()
    calls = []
    monkeypatch.setattr(padding_free, "sdpa_attention_forward",
                        lambda *a, **k: calls.append(1) or sdpa_attention_forward(*a, **k))
    padded, packed = actors(model)
    assert_equal_passes(padded, packed, rows, torch.float32)
    assert len(calls) == (0 if checkpointing else rows.batch_size * model.config.num_hidden_layers)
    assert model.config._attn_implementation == attention


def test_packed_pass_equals_the_shared_prompt_pass(rows, monkeypatch):
    """Off, a policy without a tap runs each group's prompt once; on, packed rows instead: the same outputs."""
    model = policy(torch.float32)
    padded, packed = actors(model)
    calls = []
    monkeypatch.setattr(actor_module, "forward_hidden_shared_prompts",
                        lambda *a: calls.append(1) or forward_hidden_shared_prompts(*a))
    assert_equal_passes(padded, packed, rows, torch.float32)
    assert len(calls) == 1  # the padded side's forward only


def test_packed_reference_logprobs_equal_padded(rows):
    model = policy(torch.float32, lora=True)
    expected, ours = (Actor(model, None, None, KLReference(model), UpdateOptions(padding_free=free), LossOptions())
                      .reference_logprobs(rows) for free in (False, True))
    torch.testing.assert_close(ours * rows.response_mask, expected * rows.response_mask, **TOLERANCE[torch.float32])


def test_packing_layout_by_hand():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]])
    packed = PackedRows.of(mask)
    assert packed.rows.tolist() == [0, 0, 1, 1, 1, 1, 2] and packed.cols.tolist() == [1, 2, 0, 1, 2, 3, 2]
    assert packed.positions.tolist() == [0, 1, 0, 1, 2, 3, 0]
    unpacked = packed.unpack(torch.arange(1.0, 8.0)[:, None].repeat(2, 1, 2))  # 2×T×2 → 2×B×S×2
    assert unpacked.shape == (2, 3, 4, 2)
    assert unpacked[1, :, :, 0].tolist() == [[0, 1, 2, 0], [3, 4, 5, 6], [0, 0, 7, 0]]


def test_models_whose_attention_cannot_pack_run_padded(rows):
    model = policy(torch.float32)
    model.config._attn_implementation = "a_custom_kernel"
    assert not packs_rows(model)
    assert not Actor(model, None, None, None, UpdateOptions(padding_free=True), LossOptions()).padding_free


def test_padding_free_budget_counts_real_tokens():
    lengths = torch.tensor([7, 5, 5, 2, 2, 2])
    assert [(r.start, r.stop) for r in pack_by_token_budget(lengths, 12, padded=False)] == [(0, 2), (2, 6)]
    assert [(r.start, r.stop) for r in pack_by_token_budget(torch.tensor([2, 9, 3]), 12, padded=False)] == [
        (0, 2), (2, 3)]  # any order
    assert [(r.start, r.stop) for r in pack_by_token_budget(lengths, 12, count=3, padded=False)] == [
        (0, 1), (1, 2), (2, 6)]  # the costliest run (12) halved
    # left padding counts in the padded cost, not in the packed one: 2 rows of 3 real tokens in 6 columns
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]])
    assert [len(r) for r in micro_batch_rows(mask, None, 6)] == [1, 1]
    assert [len(r) for r in micro_batch_rows(mask, None, 6, padding_free=True)] == [2]


@pytest.mark.slow
def test_zero3_step_packed_equals_padded(tmp_path):
    """2 CPU ranks under ZeRO-3 holding 6 and 2 rows (tests/step/zero3_padding_free_job.py): one RL step packed gives
    the padded step's scored log-probs, statistics and updated weights, with no padded position in its forwards."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("deepspeed")
    job = Path(__file__).with_name("zero3_padding_free_job.py")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    for side in ("padded", "packed"):
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                 str(job), side, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    initial = dict(load_backbone("bundled:tiny_adder", "float32", False)[0].named_parameters())
    for rank in (0, 1):
        padded, packed = (torch.load(tmp_path / f"{side}_rank{rank}.pt") for side in ("padded", "packed"))
        torch.testing.assert_close(packed["old_logprobs"], padded["old_logprobs"], **TOLERANCE[torch.float32])
        assert packed["stats"].pop("perf/padding_frac") == 0.0
        assert padded["stats"].pop("perf/padding_frac") > 0.0 or rank == 1  # rank 1's two rows are equally long
        assert packed["stats"].keys() == padded["stats"].keys()
        for key, value in padded["stats"].items():
            # the fp32 tolerance of the log-probs they are computed from (the second minibatch's follow an lr-1 step)
            assert packed["stats"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
        assert max(float((padded["weights"][name] - initial[name]).abs().max()) for name in initial) > 1e-3
        for name, weight in padded["weights"].items():
            torch.testing.assert_close(packed["weights"][name], weight, atol=1e-6, rtol=1e-5, msg=name)
