"""Dress rehearsals of the paper configs as shipped (tests/paper_rehearsal.py): 2 CPU ranks under their DeepSpeed
ZeRO config, ranks that disagree (response lengths, accepted rollouts, chunk and piece counts), a few steps each.

What must hold at scale holds here: no collective mismatch or hang (a timeout fails), the ranks end with the same
weights, the policy and the flow trained, the run validated and exported; and the probe shows the ranks really did
pad (one rank had fewer LM-head chunks, flow-scoring chunks, flow-loss pieces than the other) — a rehearsal in which
every rank had the same counts would prove nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import paper_rehearsal
from rlfr_run import metrics
from rollout_server_process import BACKENDS, HAS_VLLM, RolloutServer, served_greedy

pytestmark = pytest.mark.slow


def probed(root: Path) -> list[str]:
    return ["--trainer.callbacks+=rehearsal_probe.RehearsalProbe", "--trainer.callbacks.out", str(root / "probe"),
            "--trainer.callbacks+=rank_weights.RankWeights", "--trainer.callbacks.out", str(root / "weights")]


def rank_files(root: Path, pattern: str, load) -> list:
    return [load(root / pattern.format(rank=rank)) for rank in range(2)]


def assert_ranks_equal_and_trained(root: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    rank0, rank1 = rank_files(root, "weights/rank{rank}.safetensors", lambda p: load_file(str(p)))
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        torch.testing.assert_close(rank0[name], rank1[name], rtol=0, atol=0, msg=name)
    for prefix in prefixes:
        names = [k.removeprefix("start/") for k in rank0 if k.startswith(f"start/{prefix}")]
        assert names and any(not torch.equal(rank0[f"start/{n}"], rank0[f"end/{n}"]) for n in names), prefix
    return rank0


def padded(root: Path, site: str) -> bool:
    """Some rank ran fewer real calls than were agreed at some point of ``site`` (it padded). The LM head is called
    once per micro-batch whatever its tokens: there, the ranks called it equally often while their micro-batches
    carried different numbers of tokens."""
    records = rank_files(root, "probe/probe_rank{rank}.json", lambda p: json.loads(p.read_text()))
    assert all(records[rank][site] for rank in range(2)), f"{site} was never reached"
    if site == "lm_head":
        calls = [record[site] for record in records]
        assert len(calls[0]) == len(calls[1]), f"the ranks called the LM head {len(calls[0])} and {len(calls[1])} times"
        return any(mine[0] != theirs[0] for mine, theirs in zip(*calls))
    return any(count < agreed for record in records for count, agreed in record[site])


def test_rlfr_qwen_as_shipped_keeps_uneven_ranks_in_step(tmp_path):
    """rlfr_qwen.yaml as shipped on 2 ZeRO-3 ranks in bf16 (HF rollouts: vLLM is rehearsed in its own venv), with an
    online flow step: 3 steps, validation, export."""
    paper_rehearsal.run("rlfr_qwen.yaml", tmp_path, 3, "--model.init_args.rollout.engine", "hf", *probed(tmp_path))
    assert_ranks_equal_and_trained(tmp_path, ("policy.", "reward_model."))
    for site in ("lm_head", "flow_scoring", "flow_pieces"):
        assert padded(tmp_path, site), f"the ranks never disagreed at {site}: the rehearsal proves nothing there"
    version = next((tmp_path / "run").glob("version_*"))
    steps = metrics(version)
    # the flow stepped (κ 2) once every rank's samples had 2 accepted rows, in whichever step that was
    assert sorted(steps) == [1, 2, 3] and any(float(values["flow/loss"]) > 0 for values in steps.values())
    assert "val/heldout/pass@1" in steps[3]
    assert (version / "export" / "flow.safetensors").is_file() and (version / "export" / "hf_policy").is_dir()


@pytest.mark.parametrize("backend", BACKENDS)
def test_rlfr_qwen_async_as_shipped_with_a_rollout_server_keeps_uneven_ranks_in_step(tmp_path, backend):
    """rlfr_qwen_async.yaml as shipped (ZeRO-3, bf16, the server engine, ``max_staleness: 1`` with partial rollouts,
    token TIS) on 2 ranks plus one ``flowkit rollout-server`` process on loopback: 3 steps, validation, export. The
    ranks stay in step where they disagree; step 1 samples the weights it trains (nothing prefetched yet), steps 2
    and 3 rows generated while the step before trained, one version behind, none regenerated; and at the end the
    server holds the trained weights (its greedy decode is theirs). The server runs in fp32 (the config's header
    starts it in bf16): it holds the pushed bf16 values exactly, so its decode is compared with the trained weights'
    exactly.

    Once per server backend: ``hf``, and ``vllm`` as the config's header starts it (run in the vLLM venv, ``-m
    vllm``, where the trainer's ranks run that venv's DeepSpeed, installed there by .ci/run, under the same ZeRO-3
    config)."""
    from flowkit.llm.backbone import load_backbone
    from flowkit.llm.hf_engine import HFRolloutEngine

    server = RolloutServer(tmp_path / "server.log", timeout_s=600, backend=backend)
    try:
        paper_rehearsal.run("rlfr_qwen_async.yaml", tmp_path, 3, "--model.init_args.rollout.server_url", server.url,
                            *probed(tmp_path))
        weights = assert_ranks_equal_and_trained(tmp_path, ("policy.", "reward_model."))
        prompts = ["47+38=", "12+13=", "7+5="]
        served = served_greedy(server.url, prompts, version=3, max_new_tokens=28, timeout_s=120)
    finally:
        server.kill()
    for site in ("lm_head", "flow_scoring", "flow_pieces"):
        assert padded(tmp_path, site), f"the ranks never disagreed at {site}: the rehearsal proves nothing there"
    version = next((tmp_path / "run").glob("version_*"))
    steps = metrics(version)
    # the flow stepped (κ 2) once the server's samples had 2 accepted rows, in whichever step that was
    assert sorted(steps) == [1, 2, 3] and any(float(values["flow/loss"]) > 0 for values in steps.values())
    assert [float(steps[step]["rollout/staleness_max"]) for step in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert float(steps[3]["rollout/regenerated_rows"]) == 0.0
    assert "val/heldout/pass@1" in steps[3]
    assert (version / "export" / "flow.safetensors").is_file() and (version / "export" / "hf_policy").is_dir()
    trained, tokenizer = load_backbone("bundled:tiny_adder")
    trained.load_state_dict({k.removeprefix("end/policy."): v for k, v in weights.items()
                             if k.startswith("end/policy.")}, strict=False)
    mine = HFRolloutEngine(trained, tokenizer, max_new_tokens=28).generate(prompts, 1, temperature=0)
    assert served == [ids[mask.bool()].tolist() for ids, mask in zip(mine.input_ids, mine.response_mask)]


def assert_uneven_episodes(root: Path) -> dict[int, dict[str, str]]:
    """The agent rehearsal's episodes: multi-turn with tool calls, the ranks' of different lengths and turn counts
    in every step, the policy and the flow trained, the ranks still in step; the logged metrics, by step."""
    assert_ranks_equal_and_trained(root, ("policy.", "reward_model."))
    records = rank_files(root, "probe/probe_rank{rank}.json", lambda p: json.loads(p.read_text()))
    episodes = [record["episodes"] for record in records]  # per rank, per step: (policy turns, tool calls, tokens)
    assert len(episodes[0]) == len(episodes[1]) == 3
    rows = [row for rank in episodes for step in rank for row in step]
    assert any(turns > 1 for turns, _, _ in rows) and any(calls > 0 for _, calls, _ in rows)
    for mine, theirs in zip(*episodes):
        assert sorted(row[2] for row in mine) != sorted(row[2] for row in theirs)  # tokens per episode
    assert any(sorted(row[0] for row in mine) != sorted(row[0] for row in theirs) for mine, theirs in zip(*episodes))
    for site in ("lm_head", "flow_scoring", "flow_pieces"):
        assert padded(root, site), f"the ranks never disagreed at {site}: the rehearsal proves nothing there"
    version = next((root / "run").glob("version_*"))
    steps = metrics(version)
    assert sorted(steps) == [1, 2, 3] and any(float(values["flow/loss"]) > 0 for values in steps.values())
    assert all(float(values["episodes/tool_calls"]) > 0 and float(values["episodes/turns_mean"]) > 1
               for values in steps.values())
    assert (version / "export" / "flow.safetensors").is_file() and (version / "export" / "hf_policy").is_dir()
    return steps


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_rlfr_qwen_tools_as_shipped_keeps_ranks_with_uneven_episodes_in_step(tmp_path):
    """rlfr_qwen_tools.yaml as shipped (ZeRO-3, bf16, colocated vLLM engines, Hermes tool calls, the flow reward) on
    2 ranks whose episodes differ in length and turn count: 3 steps and the export. Each rank's vLLM engine decodes
    its own episodes' turns, as many generate calls as they need (run in the vLLM venv, ``-m vllm``)."""
    paper_rehearsal.run("rlfr_qwen_tools.yaml", tmp_path, 3, *probed(tmp_path))
    assert_uneven_episodes(tmp_path)


def test_rlfr_qwen_tools_with_hf_rollouts_keeps_ranks_with_uneven_episodes_in_step(tmp_path):
    """The same rehearsal with HF rollouts in the main venv: under ZeRO-3 each generation gathers the sharded
    weights whole (the trainer's ``whole_weights``), a collective, so the ranks make the same number of generate
    calls while their episodes need different numbers of turns (a rank with no episode ready decodes a padding row);
    a hang fails (the run's timeout)."""
    paper_rehearsal.run("rlfr_qwen_tools.yaml", tmp_path, 3, "--model.init_args.rollout.engine", "hf",
                        *probed(tmp_path))
    assert_uneven_episodes(tmp_path)


# DAPO's controls on (3 draws, truncated rows masked, an overlong buffer of 8 at penalty 0.5) under
# tests/uneven_groups.py's reward, by which rank 0 keeps 2 groups and rank 1, out of draws, 1 group per step
# The official preset freezes the flow (its scripts' online loss has no graph, docs/methods/rlfr.md); these rehearsals
# train it with the official per-micro-batch loss, whose ranks must stay in step.
OFFICIAL_ONLINE = ("--model.init_args.reward_model.init_args.online.online_update", "true")
UNEVEN_DAPO = ("--model.init_args.controls.dynamic_sampling_max_draws", "3",
               "--model.init_args.controls.mask_truncated", "true",
               "--model.init_args.controls.overlong_buffer_length", "8",
               "--model.init_args.controls.overlong_penalty", "0.5",
               "--model.init_args.outcome_reward", "none",
               "--model.init_args.reward_functions", "[{function: uneven_groups.rank_dependent_reward}]")


def assert_uneven_groups_kept_and_padded(root: Path) -> None:
    """Under UNEVEN_DAPO rank 0 kept 2 groups (16 rows) and rank 1 one (8 rows) in both steps, and the ranks padded
    where they disagreed: the LM head, the scoring pass and the flow loss's pieces."""
    records = rank_files(root, "probe/probe_rank{rank}.json", lambda p: json.loads(p.read_text()))
    assert [records[rank]["kept"] for rank in range(2)] == [[[2, 16], [2, 16]], [[1, 8], [1, 8]]]
    for site in ("lm_head", "flow_scoring", "flow_pieces"):
        assert padded(root, site), f"the ranks never disagreed at {site}: the rehearsal proves nothing there"


def assert_dapo_draws(step: dict[str, str]) -> None:
    drawn, kept = float(step["train/groups_drawn"]), float(step["train/groups_kept"])
    assert 2 <= drawn <= 6 and kept <= 2  # 2 prompts per rank and draw, at most 3 draws
    assert 0 <= float(step["train/truncated_frac"]) <= 1


def test_rlfr_qwen_official_with_dapo_controls_and_a_token_budget_keeps_uneven_ranks_in_step(tmp_path):
    """rlfr_qwen_official.yaml with the online update on (the official per-micro-batch flow loss, 8 minibatches) on 2
    ZeRO-3 ranks, micro-batches cut by a token budget, with DAPO's controls on and an outcome reward
    (tests/uneven_groups.py) under which rank 0 keeps 2 groups (16 rows) and rank 1, out of draws, 1 group (8 rows)
    per step: ranks accept different numbers of rows and keep different numbers of groups, and still run as many
    flow pieces, draws, minibatches and micro-batches (padding ones: the scoring pass's under the budget too). 2 RL
    steps of 8 optimizer steps. The preset's micro-batches of 1 row run in the every-option rehearsal below."""
    paper_rehearsal.run("rlfr_qwen_official.yaml", tmp_path, 16, "--model.init_args.rollout.engine", "hf",
                        *OFFICIAL_ONLINE, *UNEVEN_DAPO, "--model.init_args.update.micro_batch_tokens", "64",
                        *probed(tmp_path))
    assert_ranks_equal_and_trained(tmp_path, ("policy.", "reward_model."))
    assert_uneven_groups_kept_and_padded(tmp_path)
    steps = metrics(next((tmp_path / "run").glob("version_*")))
    assert sorted(steps) == [1, 2]
    for step in steps.values():
        assert float(step["flow/loss"]) > 0  # the official cadence: a flow step in every RL step
        assert_dapo_draws(step)


def test_rlfr_qwen_official_with_every_online_option_keeps_uneven_ranks_in_step(tmp_path):
    """rlfr_qwen_official.yaml on 2 ZeRO-3 ranks with every option of the official online protocol on at once —
    ``soft_weight`` 0.3, ``correct+token_entropy`` at ``entropy_quantile`` 0.5, ``score_power`` 2,
    ``flow_warmup_steps`` 1 — and DAPO's controls (dynamic sampling, ``mask_truncated``, the overlong buffer), under
    tests/uneven_groups.py's reward: rank 0 keeps 2 groups (16 rows), rank 1 one group (8 rows) per step, so their
    flow losses weigh different rows (the grader's verdicts, the correct rows, differ too) in different numbers of
    pieces. RL step 0 is the flow's warm-up (1 optimizer step: the policy must not move, the flow must), step 1
    trains both (8 minibatches of the preset's micro-batches of 1 row): max_steps 9. The ranks end equal, padded
    where they disagreed, and the options' metrics are logged and finite."""
    online = {"online.soft_weight": "0.3", "online.rejection_metric": "correct+token_entropy",
              "online.entropy_quantile": "0.5", "scoring.score_power": "2", "online.flow_warmup_steps": "1"}
    options = [arg for name, value in online.items()
               for arg in (f"--model.init_args.reward_model.init_args.{name}", value)]
    paper_rehearsal.run("rlfr_qwen_official.yaml", tmp_path, 9, "--model.init_args.rollout.engine", "hf", *options,
                        *OFFICIAL_ONLINE, *UNEVEN_DAPO,
                        *probed(tmp_path), "--trainer.callbacks.every_step", "true")
    weights = assert_ranks_equal_and_trained(tmp_path, ("policy.", "reward_model."))
    assert_uneven_groups_kept_and_padded(tmp_path)

    def changed(prefix: str, before: str, after: str) -> bool:
        names = [k.removeprefix(f"{before}/") for k in weights if k.startswith(f"{before}/{prefix}")]
        assert names, prefix
        return any(not torch.equal(weights[f"{before}/{n}"], weights[f"{after}/{n}"]) for n in names)
    assert not changed("policy.", "start", "step0"), "the policy moved in its warm-up step"
    assert changed("reward_model.", "start", "step0"), "the flow did not train in the warm-up step"
    assert changed("policy.", "step0", "step1") and changed("reward_model.", "step0", "step1")

    steps = metrics(next((tmp_path / "run").glob("version_*")))
    assert len(steps) == 2, sorted(steps)
    for step in steps.values():
        for name in ("flow/loss", "flow/accepted_frac", "flow/token_weight_frac", "flow/reward_mean",
                     "train/truncated_frac", "train/zero_advantage_group_frac", "train/groups_kept"):
            assert name in step and math.isfinite(float(step[name])), (name, step.get(name))
        assert float(step["flow/loss"]) > 0
        assert 0 < float(step["flow/token_weight_frac"]) < 1  # the entropy quantile weighed some tokens soft_weight
        assert_dapo_draws(step)
    assert "train/policy_loss" in steps[max(steps)]


def test_rlfr_qwen_switches_users_flip(tmp_path):
    """The same rehearsal with LoRA, PPO epochs × minibatches, a KL to the initial policy and a κ no step reaches:
    2 RL steps of 2 × 2 optimizer steps (``max_steps`` counts optimizer steps)."""
    paper_rehearsal.run("rlfr_qwen.yaml", tmp_path, 8, "--model.init_args.rollout.engine", "hf",
                        "--model.init_args.lora", "{r: 4, alpha: 8, target_modules: [q_proj, v_proj]}",
                        "--model.init_args.update.ppo_epochs", "2", "--model.init_args.update.num_minibatches", "2",
                        "--model.init_args.loss.kl_coef", "0.01",
                        "--model.init_args.reward_model.init_args.online.kappa", "10000", *probed(tmp_path))
    weights = assert_ranks_equal_and_trained(tmp_path, ("policy.",))
    assert all(torch.equal(weights[k], weights[k.replace("start/", "end/")])
               for k in weights if k.startswith("start/reward_model."))  # κ not reached: the flow never stepped
    assert padded(tmp_path, "lm_head") and padded(tmp_path, "flow_scoring")
    steps = metrics(next((tmp_path / "run").glob("version_*")))
    assert sorted(steps) == [1, 2] and "train/kl" in steps[2]  # logged once per RL step


def test_rlfr_qwen_offline_as_shipped_pads_pretraining_pieces(tmp_path):
    """rlfr_qwen_offline.yaml (FlowRewardModule, ZeRO-2, bf16) on 2 ranks whose solutions differ in length: several
    row-bounded pieces per batch, agreed over the ranks."""
    paper_rehearsal.run("rlfr_qwen_offline.yaml", tmp_path, 3, *probed(tmp_path))
    assert_ranks_equal_and_trained(tmp_path, ("reward_model.",))
    records = rank_files(tmp_path, "probe/probe_rank{rank}.json", lambda p: json.loads(p.read_text()))
    assert all(len(r["flow_pieces"]) == 3 and all(agreed > 1 for _, agreed in r["flow_pieces"]) for r in records)
    assert any(count < agreed for r in records for count, agreed in r["flow_pieces"])
    assert (next((tmp_path / "run").glob("version_*")) / "export" / "flow.safetensors").is_file()


def test_explain_llama_as_shipped_keeps_uneven_ranks_in_step(tmp_path):
    """explain_llama.yaml as shipped on 2 ZeRO-3 ranks in bf16 — LoRA, the SFT start, the flow's round (flow fitted
    on the union of both ranks' accepted explanations), PPO with a value head and the KL in the reward: 2 RL steps and
    the round's and the final evaluation."""
    paper_rehearsal.run("explain_llama.yaml", tmp_path, 2, *probed(tmp_path))
    weights = assert_ranks_equal_and_trained(tmp_path, ("value_head.", "reward_model.flow."))
    lora = [k.removeprefix("start/") for k in weights if k.startswith("start/") and "lora_" in k and ".default." in k]
    assert lora and any(not torch.equal(weights[f"start/{n}"], weights[f"end/{n}"]) for n in lora)
    assert padded(tmp_path, "lm_head")
    steps = metrics(next((tmp_path / "run").glob("version_*")))
    logged = {key for values in steps.values() for key in values}
    assert {"sft/loss", "round/flow_pairs", "train/value_loss", "final/explanation_accuracy"} <= logged
    assert all(float(values["round/flow_pairs"]) > 0 for values in steps.values() if "round/flow_pairs" in values)


def test_zero3_equals_ddp_on_rlfr_qwen_settings(tmp_path):
    """rlfr_qwen.yaml's settings in fp32 on 2 ranks with uneven lengths and acceptance: ZeRO-3 (sharded weights,
    padded calls) and DDP (whole weights, gradients averaged once per step) end 2 steps with the same weights."""
    fp32 = ["--model.init_args.rollout.engine", "hf", "--trainer.precision", "32-true", "--model.init_args.dtype",
            "float32", "--model.init_args.optim.lr", "2e-3", "--model.init_args.optim.flow_lr", "2e-3",  # moves ≫ the tolerance
            "--trainer.callbacks+=rank_weights.RankWeights"]
    paper_rehearsal.run("rlfr_qwen.yaml", tmp_path / "zero3", 2, *fp32, "--trainer.callbacks.out",
                        str(tmp_path / "zero3" / "weights"))
    paper_rehearsal.run("rlfr_qwen.yaml", tmp_path / "ddp", 2, *fp32, "--trainer.callbacks.out",
                        str(tmp_path / "ddp" / "weights"), "--trainer.strategy", "ddp")
    zero3 = load_file(str(tmp_path / "zero3" / "weights" / "rank0.safetensors"))
    ddp = load_file(str(tmp_path / "ddp" / "weights" / "rank0.safetensors"))
    assert zero3.keys() == ddp.keys()
    moved = 0.0
    for name in zero3:
        torch.testing.assert_close(zero3[name], ddp[name], rtol=0, atol=1e-4, msg=name)
        if name.startswith("end/"):
            moved = max(moved, float((zero3[name] - zero3[name.replace("end/", "start/")]).abs().max()))
    assert moved > 1e-3  # the weights moved far more than the tolerance
