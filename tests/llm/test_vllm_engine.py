"""The colocated vLLM rollout engine: RolloutBatch layout, sampler log-probs, weight sync after RL steps.

The ``vllm``-marked tests need vLLM (CI runs them in a second venv with ``vllm-cpu``; see ``.ci/run``) and skip
without it. The bundled tiny_adder directory loads in vLLM as it is: prompts go in as token ids and
responses are decoded by flowkit's tokenizer, so vLLM never loads the tokenizer.
"""

from __future__ import annotations

import csv
import gc
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from flowkit.errors import ConfigError
from flowkit.llm.backbone import load_backbone, resolve_backbone_path
from flowkit.llm.lora import LoraSettings
from flowkit.llm.forward import forward_logits
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.modules.policy_options import AdvantageOptions, LossOptions, OptimOptions, RolloutOptions, SamplingOptions
from flowkit.rl.logprobs import token_logprobs
from flowkit.rl.rollout_correction import RolloutCorrection

# vLLM's in-process engine, a 1 GiB CPU KV cache (the machine is shared) and no pinning of OpenMP threads to
# cores, which would pin the test process's own threads too.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "rlfr_tiny.yaml")
HAS_VLLM = importlib.util.find_spec("vllm") is not None

# fp32 on CPU: vLLM's kernels and HF's eager attention sum in different orders. On 16 prompts × 8 samples of the
# tiny model (3022 response tokens) their log-probs differed by 8.1e-6 at most, 1.1e-7 on average (measured
# once); 1e-4 leaves room across CPUs and stays far below what a missed weight sync shows (> 1e-2, checked below).
LOGPROB_TOLERANCE = 1e-4


def val_prompts(count: int) -> tuple[list[str], list[str]]:
    rows = [json.loads(line) for line in (ROOT / "flowkit/assets/arithmetic/val.jsonl").read_text().splitlines()[:count]]
    return [r["prompt"] for r in rows], [r["answer"] for r in rows]


def release(module_or_engine) -> None:
    """Drop a vLLM engine (and its KV cache) before the next test builds one."""
    engine = getattr(module_or_engine, "rollout_engine", module_or_engine)
    engine.llm = None
    gc.collect()


def recomputed_logprobs(model: torch.nn.Module, batch) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(forward_logits(model, batch), batch.input_ids) * batch.response_mask


def assert_synced(module: PolicyModule, initial: torch.nn.Module, prompts: list[str]) -> None:
    """vLLM samples the trained policy: greedy completions equal HF greedy generation with the trained weights,
    and its log-probs of its own samples match the trained policy's recomputation, not the initial policy's."""
    hf = HFRolloutEngine(module.policy, module.tokenizer, module.sampling.max_new_tokens)
    greedy_vllm = module.rollout_engine.generate(prompts, 1, temperature=0)
    greedy_hf = hf.generate(prompts, 1, temperature=0)
    assert greedy_vllm.responses == greedy_hf.responses
    assert torch.equal(greedy_vllm.input_ids, greedy_hf.input_ids)
    assert torch.equal(greedy_vllm.response_mask, greedy_hf.response_mask)

    sampled = module.rollout_engine.generate(prompts, 2, temperature=1.0)
    trained_gap = (sampled.rollout_logprobs - recomputed_logprobs(module.policy, sampled)).abs().max()
    stale_gap = (sampled.rollout_logprobs - recomputed_logprobs(initial, sampled)).abs().max()
    assert trained_gap < LOGPROB_TOLERANCE, trained_gap
    assert stale_gap > 100 * LOGPROB_TOLERANCE, stale_gap  # the 3 steps moved the weights: a stale copy would show


def test_missing_vllm_is_a_one_line_config_error():
    if HAS_VLLM:
        pytest.skip("vLLM is installed")
    with pytest.raises(ConfigError, match=r"^PolicyModule.rollout.engine 'vllm' needs vLLM .*pip install flowkit\[vllm\]"):
        PolicyModule(rollout=RolloutOptions(engine="vllm"))


def test_unknown_rollout_engine_is_a_config_error():
    with pytest.raises(ConfigError, match="rollout.engine must be one of hf, vllm, server, got .sglang."):
        PolicyModule(rollout=RolloutOptions(engine="sglang"))


@pytest.mark.parametrize("option, value", [("vllm_gpu_memory_utilization", 0.0), ("vllm_max_model_len", 0)])
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_bad_vllm_settings_are_config_errors(option, value):
    with pytest.raises(ConfigError, match=f"PolicyModule.rollout.{option}"):
        PolicyModule(rollout=RolloutOptions(engine="vllm", **{option: value}))


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_layout_and_token_in_rows_match_hf_engine_and_sampler_logprobs_match_the_trainer(single_thread):
    from flowkit.llm.vllm_engine import VllmRolloutEngine

    torch.manual_seed(0)
    policy, tokenizer = load_backbone("bundled:tiny_adder")
    engine = VllmRolloutEngine(policy, tokenizer, resolve_backbone_path("bundled:tiny_adder"), max_new_tokens=28)
    hf = HFRolloutEngine(policy, tokenizer, max_new_tokens=28)
    prompts, answers = val_prompts(6)
    prompts[0] = "7+5="  # a shorter prompt, so rows are left-padded

    # The first generation builds the engine, which leaves the trainer's RNG streams where they were (vLLM seeds
    # them in its constructor; greedy sampling draws nothing from them).
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    ours = engine.generate(prompts, 1, answers, temperature=0)
    assert engine.llm is not None and torch.equal(torch.rand(3), expected)

    # Greedy: the same RolloutBatch as HF generate, field by field.
    theirs = hf.generate(prompts, 1, answers, temperature=0)
    for name in ["input_ids", "attention_mask", "response_mask", "group_ids"]:
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert (ours.responses, ours.prompts, ours.answers) == (theirs.responses, theirs.prompts, theirs.answers)
    assert (ours.attention_mask[:, 0] == 0).any()  # left padding was exercised

    # Token-in: the prompts' ids give the same greedy rows, each cut at its own limit, the engine's version on each.
    rows = [ours.input_ids[row][ours.response_mask[row].bool()].tolist() for row in range(len(prompts))]
    engine.policy_version = 3
    rollouts = engine.generate_from_ids([tokenizer(prompt)["input_ids"] for prompt in prompts],
                                        [2] + [100] * (len(prompts) - 1), temperature=0)
    assert rollouts.ids == [rows[0][:2], *rows[1:]] and rollouts.versions == [[3] * len(ids) for ids in rollouts.ids]
    assert [len(logprobs) for logprobs in rollouts.logprobs] == [len(ids) for ids in rollouts.ids]

    # Sampled, n = 4: groups in prompt order, mask up to and including EOS, log-probs only on response tokens.
    batch = engine.generate(prompts, 4, answers)
    assert batch.group_ids.tolist() == [i for i in range(len(prompts)) for _ in range(4)]
    assert batch.prompts == [p for p in prompts for _ in range(4)]
    prompt_width = ours.input_ids.shape[1] - ours.response_mask.sum(-1).max().long().item()
    response = batch.input_ids[:, prompt_width:]
    eos = tokenizer.eos_token_id
    for row in range(batch.batch_size):
        length = int(batch.response_mask[row].sum())
        tokens = response[row, :length].tolist()
        assert eos not in tokens[:-1] and (tokens[-1] == eos or length == 28)
        assert tokenizer.decode(tokens, skip_special_tokens=True) == batch.responses[row]
    assert torch.all(batch.rollout_logprobs[batch.response_mask == 0] == 0)
    assert torch.all(batch.rollout_logprobs[batch.response_mask == 1] < 0)
    gap = (batch.rollout_logprobs - recomputed_logprobs(policy, batch)).abs().max()
    assert gap < LOGPROB_TOLERANCE, gap
    assert not engine.saw_nonfinite_logits
    release(engine)


def fit_policy(tmp_path: Path, **options) -> PolicyModule:
    """3 plain-GRPO steps of 4 prompts × 4 samples with the vLLM engine, lr high enough to move greedy outputs."""
    L.seed_everything(0)
    module = PolicyModule(outcome_reward="binary", **options,
                          sampling=SamplingOptions(num_samples=4, max_new_tokens=28),
                          loss=LossOptions(rollout_correction=RolloutCorrection(mode="token_tis", cap=2.0)),
                          rollout=RolloutOptions(engine="vllm"))
    data = RolloutDataModule(batch_size=4, val_path=None)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, data)
    return module


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_lora_weights_are_merged_into_vllm_after_three_rl_steps(tmp_path, single_thread):
    module = fit_policy(tmp_path, lora=LoraSettings(r=8, alpha=16), optim=OptimOptions(lr=2e-2))
    initial, _ = load_backbone("bundled:tiny_adder")
    assert_synced(module, initial, val_prompts(8)[0])
    release(module)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_tiny_rlfr_job_runs_end_to_end_with_vllm_and_syncs_full_weights(tmp_path, monkeypatch, single_thread):
    from flowkit.cli import FlowkitCLI

    monkeypatch.chdir(tmp_path)
    cli = FlowkitCLI(args=[
        "fit", "--config", CONFIG, "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
        "--trainer.enable_progress_bar", "false", "--model.init_args.rollout.engine", "vllm",
        "--model.init_args.loss.rollout_correction.mode", "token_tis", "--model.init_args.optim.lr", "1e-3",
        "--model.init_args.flow_pretrain.steps", "3", "--model.init_args.reward_model.init_args.online.kappa", "4",
        "--data.init_args.batch_size", "4", "--model.init_args.sampling.num_samples", "4",
        "--data.init_args.max_val_examples", "16",
    ])
    with open(Path(cli.trainer.logger.log_dir) / "metrics.csv") as f:
        logged = {k for row in csv.DictReader(f) for k, v in row.items() if v}
    for key in ["train/outcome_reward", "train/policy_loss", "flow/reward_mean", "val/heldout/pass@1"]:
        assert key in logged, key
    run_dir = next(tmp_path.glob("runs/rlfr_tiny/version_*"))
    assert (run_dir / "export/hf_policy/model.safetensors").is_file()
    initial, _ = load_backbone("bundled:tiny_adder")
    assert_synced(cli.model, initial, val_prompts(8)[0])
    release(cli.model)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_explanation_method_rolls_out_with_vllm_and_syncs_its_lora(tmp_path, single_thread):
    """The explanation method on the same engine (``PolicyModule`` + ``ExplanationReward`` + one round of
    ``ExplanationRounds``, LoRA) with ``rollout_engine: vllm``: the round's explanations, the PPO rollouts and the
    evaluations come from vLLM, and afterwards vLLM samples the trained policy. The policy is a random one with the
    bundled explanation policy's word-level tokenizer and head size 32: vLLM's CPU attention has no kernel for the
    bundled policy's head size 24."""
    from transformers import AutoTokenizer

    from flowkit.llm.tiny import tiny_qwen2
    from flowkit.modules.explanation import ExplanationDataModule, ExplanationRounds
    from flowkit.rewards import ExplanationReward

    tokenizer = AutoTokenizer.from_pretrained(resolve_backbone_path("bundled:explain_tiny/policy"))
    torch.manual_seed(0)
    tiny_qwen2(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id).save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    torch.manual_seed(0)
    reward = ExplanationReward(proxies=[f"bundled:explain_tiny/proxy{i}" for i in (0, 1)],
                               evaluators=["bundled:explain_tiny/proxy2"], ode_steps=3, num_draws=4, flow_time_dim=16,
                               flow_projector_dim=32, explanations_per_context=2, round_contexts=8,
                               heldout_contexts=8, flow_epochs_per_round=2, flow_batch_size=16)
    module = PolicyModule(backbone=str(tmp_path / "policy"), lora=LoraSettings(r=4, alpha=4), reward_model=reward,
                          outcome_reward="none", sampling=SamplingOptions(num_samples=2, max_new_tokens=16),
                          advantage=AdvantageOptions(estimator="gae"),
                          loss=LossOptions(kl_coef=0.05, kl_estimator="k1", kl_in="reward"),
                          optim=OptimOptions(lr=2e-2, flow_lr=1e-3), rollout=RolloutOptions(engine="vllm"))
    data = ExplanationDataModule(num_train=8, num_test=8, batch_size=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=-1, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ExplanationRounds(1, 1)])
    trainer.fit(module, datamodule=data)
    metrics = trainer.logged_metrics
    for key in ("round/acceptance", "train/policy_loss", "train/value_loss", "final/explanation_accuracy"):
        assert key in metrics and torch.isfinite(torch.as_tensor(metrics[key])), key
    assert trainer.global_step == 2
    initial, _ = load_backbone(str(tmp_path / "policy"))
    assert_synced(module, initial, [record["prompt"] for record in data.test_records[:6]])
    release(module)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_a_push_that_breaks_off_inside_a_layer_does_not_spoil_the_next_whole_one(single_thread):
    """The rollout server's loading (``load_weights_one_by_one``): a push of the backbone's weights that breaks off
    inside a layer (its q and k in, v not), then a whole push of other weights: vLLM's greedy decode is then theirs
    (HF's). The failed push's layerwise reload session was closed; left open (one ``reload_weights`` over each stream,
    as the colocated engine loads), vLLM 0.32's next load failed ("'Parameter' object has no attribute
    'weight_loader'", tried)."""
    from flowkit.llm.vllm_engine import build_llm, load_weights_one_by_one, policy_weights, sample, sampling_params

    torch.manual_seed(0)
    backbone, tokenizer = load_backbone("bundled:tiny_adder")
    other, _ = load_backbone("bundled:tiny_adder")
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.02 * torch.randn_like(param))
    torn = list(policy_weights(backbone))
    cut = next(i for i, (name, _) in enumerate(torn) if name == "model.layers.1.self_attn.k_proj.weight")

    def breaking_off():
        yield from torn[:cut + 1]
        raise RuntimeError("the trainer went away")

    llm = build_llm(resolve_backbone_path("bundled:tiny_adder"), torch.float32, 0, False, 0.3, 128)
    with pytest.raises(RuntimeError, match="the trainer went away"):
        load_weights_one_by_one(llm, breaking_off())
    load_weights_one_by_one(llm, policy_weights(other))
    prompts, _ = val_prompts(6)
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    served = [tokens for tokens, _ in sample(llm, prompt_ids, 1, sampling_params(tokenizer.eos_token_id, 28, 0.0, 1.0))]
    del llm
    gc.collect()
    greedy = {name: HFRolloutEngine(model, tokenizer, max_new_tokens=28).generate(prompts, 1, temperature=0)
              for name, model in (("other", other), ("backbone", backbone))}
    decoded = greedy["other"]
    expected = [ids[mask.bool()].tolist() for ids, mask in zip(decoded.input_ids, decoded.response_mask)]
    assert served == expected
    assert greedy["other"].responses != greedy["backbone"].responses  # the whole push's weights decode otherwise


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_rlfr_qwen_rehearsal_with_vllm_samples_the_trained_zero3_policy(tmp_path, monkeypatch):
    """``configs/rlfr_qwen.yaml`` rehearsed as shipped (tests/paper_rehearsal.py: 2 CPU ranks, its ZeRO-3 config,
    ``bf16-mixed``, its rollout engine, vLLM) for 3 steps. At the end every rank's vLLM completes its prompts
    greedily as HF ``generate`` does with the trained, sharded weights (tests/greedy_parity.py), and the export that
    follows gathers the shards. Beyond the rehearsal's overrides, a learning rate at which 3 steps move greedy
    outputs: at the config's 1e-6 the bf16 weights do not change, and a stale vLLM copy would pass."""
    pytest.importorskip("deepspeed")
    import paper_rehearsal

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # this venv's flowkit
    paper_rehearsal.run("rlfr_qwen.yaml", tmp_path, 3, "--trainer.callbacks+=greedy_parity.GreedyParity",
                        "--model.init_args.optim.lr", "1e-3")
    ranks = [json.loads((tmp_path / "run/greedy_parity" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for completions in ranks:
        assert completions["global_step"] == 3
        assert completions["trained_vllm"] == completions["trained_hf"], completions
    assert any(completions["trained_hf"] != completions["initial_hf"] for completions in ranks), ranks
    assert next((tmp_path / "run").glob("**/export/hf_policy/model.safetensors"), None) is not None


# ------------------------------------------------------------------ the weights a sync sends (no vLLM needed)
def lora_policy() -> torch.nn.Module:
    """The tiny policy with LoRA adapters whose B is non-zero (peft initialises B = 0, a no-op adapter)."""
    from flowkit.llm.lora import apply_lora

    torch.manual_seed(0)
    policy = apply_lora(load_backbone("bundled:tiny_adder")[0], LoraSettings(r=4, alpha=8))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return policy


def test_sync_sends_every_weight_of_a_full_model_under_its_hf_name():
    from flowkit.llm.vllm_engine import policy_weights

    model, _ = load_backbone("bundled:tiny_adder")
    sent = dict(policy_weights(model))
    expected = dict(model.named_parameters(remove_duplicate=False))
    assert sent.keys() == expected.keys()
    assert all(torch.equal(sent[name], expected[name]) for name in expected)


def test_sync_sends_lora_merged_into_the_base_weights_out_of_place():
    import copy

    from flowkit.llm.vllm_engine import policy_weights

    policy = lora_policy()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    merged = dict(copy.deepcopy(policy).merge_and_unload().named_parameters(remove_duplicate=False))
    sent = dict(policy_weights(policy))
    assert sent.keys() == merged.keys()
    for name, weight in merged.items():
        torch.testing.assert_close(sent[name], weight, rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(sent["model.layers.0.self_attn.q_proj.weight"],
                           policy.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())  # the trainer's weights untouched


def test_a_server_merging_pushed_adapters_into_its_base_gets_the_merged_weights_bit_for_bit():
    """``rollout.server_lora_push: adapter`` without the channel: the first stream (base weights and adapters) and,
    after the adapters moved as in a training step, a stream of the adapters' A and B alone (and of a base weight
    that trains too, a bias as under peft's ``bias="all"``), each fed to a :class:`ServedAdapter`, whose merge is
    then :func:`policy_weights`' merged push exactly."""
    from flowkit.llm.server_backends import ServedAdapter
    from flowkit.llm.vllm_engine import adapter_weights, lora_layout, policy_weights

    policy = lora_policy()
    policy.get_base_model().model.layers[0].self_attn.q_proj.base_layer.bias.requires_grad_(True)
    layout = lora_layout(policy)
    assert len(layout) == 4 * 7 and layout["model.layers.0.self_attn.q_proj"] == {
        "fan_in_fan_out": False, "adapters": {"default": {"r": 4, "scaling": 2.0}}}  # alpha / r
    shapes = {name: p.shape for name, p in load_backbone("bundled:tiny_adder")[0].named_parameters(
        remove_duplicate=False)}
    served = ServedAdapter(layout, shapes, channel=None, backbone="bundled:tiny_adder")
    stream = list(adapter_weights(policy, layout, with_base=True))
    assert {name for name, _ in stream} > set(shapes)
    for step in range(2):
        assert served.receive(stream) == len(stream) and not served.missing()
        merged, expected = dict(served.merged(torch.device("cpu"))), dict(policy_weights(policy))
        assert merged.keys() == expected.keys()
        assert all(torch.equal(merged[name], weight) for name, weight in expected.items())
        with torch.no_grad():
            for param in policy.parameters():
                if param.requires_grad:
                    param.add_(torch.randn_like(param), alpha=0.01)
        stream = list(adapter_weights(policy, layout, with_base=False))
        assert {name for name, _ in stream} == {"model.layers.0.self_attn.q_proj.bias"} | {
            f"{layer}.lora_{matrix}.default.weight" for layer in layout for matrix in "AB"}


ZERO3_JOB = """
import os, socket, sys
import torch
sys.path.insert(0, TESTS)
from test_vllm_engine import lora_policy
from flowkit.llm.backbone import load_backbone
from flowkit.llm.vllm_engine import policy_weights
import deepspeed

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
for kind, model in [("full", load_backbone("bundled:tiny_adder")[0]), ("lora", lora_policy())]:
    expected = {name: weight.clone() for name, weight in policy_weights(model)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trainable, lr=0.1), config=config)
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters()), "not partitioned"
    # Kept as vLLM's layerwise reload keeps a fused layer's tensors, and read at the end.
    sent = dict(policy_weights(model))
    assert all(p.numel() == 0 for p in model.parameters()), "left gathered"
    assert sent.keys() == expected.keys(), sorted(set(sent) ^ set(expected))
    for name, weight in expected.items():
        torch.testing.assert_close(sent[name], weight, rtol=0, atol=1e-6, msg=name)
    print("gathered", kind, len(sent))
"""


@pytest.mark.slow
def test_sync_gathers_zero3_partitioned_weights():
    """Under ZeRO-3 the parameters are empty shards; the sync all-gathers each weight's shards and sends full
    weights, for full fine-tuning and LoRA (merged from gathered A and B), and leaves the parameters partitioned
    (one rank here: the all-gather is the same collective with more ranks)."""
    import subprocess

    pytest.importorskip("deepspeed")
    code = f"TESTS = {str(Path(__file__).parent)!r}\n" + ZERO3_JOB
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gathered full" in result.stdout and "gathered lora" in result.stdout


IN_FLIGHT_JOB = """
import torch, deepspeed
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from flowkit.llm.backbone import load_backbone
from flowkit.llm.vllm_engine import policy_weights
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")


class Step(torch.nn.Module):
    # As PolicyModule under Lightning: the engine's module, whose forward is a step; a vLLM step runs no sub-module.
    def __init__(self):
        super().__init__()
        self.policy = load_backbone("bundled:tiny_adder")[0]

    def forward(self, ids, through_policy=True):
        return self.policy(ids).logits.float().pow(2).mean() if through_policy else ids.sum()


torch.manual_seed(0)
step = Step()
config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
engine, *_ = deepspeed.initialize(model=step, optimizer=torch.optim.SGD(step.parameters(), lr=1.0), config=config)
ids = torch.randint(3, 20, (2, 8))
for _ in range(3):  # the second forward records ZeRO-3's trace, the third prefetches by it
    engine.backward(engine(ids))
    engine.step()
with torch.no_grad():
    engine(ids, through_policy=False)
in_flight = [n for n, p in step.named_parameters() if p.ds_status == ZeroParamStatus.INFLIGHT]
assert in_flight, "nothing in flight: the job no longer sets up what it tests"
sent = dict(policy_weights(step.policy))
engine.empty_partition_cache()  # what flowkit.strategies.full_parameters does before gathering
with deepspeed.zero.GatheredParameters(list(step.policy.parameters())):
    expected = {name: p.detach().clone() for name, p in step.policy.named_parameters(remove_duplicate=False)}
assert sent.keys() == expected.keys(), sorted(set(sent) ^ set(expected))
for name, weight in expected.items():
    assert torch.equal(sent[name], weight), name
print(f"rank {torch.distributed.get_rank()} sent {len(sent)} with {len(in_flight)} in flight", flush=True)
"""


@pytest.mark.slow
def test_sync_reads_zero3_weights_while_prefetches_are_in_flight(tmp_path):
    """2 ranks, ZeRO-3: a step's forward that runs no sub-module (a vLLM step) leaves ZeRO-3's prefetch of the
    policy's parameters in flight. The sync reads every trained weight whole all the same (GatheredParameters
    died here: "Cannot partition a param in flight"), and after DeepSpeed's fetches are released they gather."""
    import subprocess

    pytest.importorskip("deepspeed")
    job = tmp_path / "in_flight.py"
    job.write_text(IN_FLIGHT_JOB)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(job)], env=env, capture_output=True, text=True, timeout=300)
    assert "rank 0 sent" in result.stdout and "rank 1 sent" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


TWO_RANK_JOB = """
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
from flowkit.llm.backbone import load_backbone, resolve_backbone_path
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.vllm_engine import VllmRolloutEngine
policy, tokenizer = load_backbone("bundled:tiny_adder")
engine = VllmRolloutEngine(policy, tokenizer, resolve_backbone_path("bundled:tiny_adder"), max_new_tokens=28)
prompts = ["47+38=", "12+13="] if dist.get_rank() == 0 else ["55+21=", "9+9="]
before = engine.generate(prompts, 1, temperature=0).responses
torch.manual_seed(dist.get_rank())
with torch.no_grad():
    for param in policy.parameters():
        param.add_(torch.randn_like(param), alpha=0.02)
engine.sync_weights(policy, 1)
after = engine.generate(prompts, 1, temperature=0).responses
assert after == HFRolloutEngine(policy, tokenizer, 28).generate(prompts, 1, temperature=0).responses, after
assert after != before
print(f"rank {dist.get_rank()} synced", flush=True)
"""


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_one_engine_per_rank_in_the_trainers_process_group(tmp_path):
    """Two ranks (gloo), each with its own colocated engine joining the existing process group (vLLM's
    external launcher); each rank's sync reaches its own engine."""
    import subprocess

    job = tmp_path / "two_ranks.py"
    job.write_text(TWO_RANK_JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(job)], env=env, capture_output=True, text=True, timeout=300)
    assert "rank 0 synced" in result.stdout and "rank 1 synced" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


# ------------------------------------------------------- colocation, against a fake vLLM (no vLLM or GPU needed)
class FakeLLM:
    """Records what the engine asks of ``vllm.LLM``, in order, into ``events``; a reload reads every weight,
    and every request completes with EOS at once."""

    def __init__(self, events: list[str], eos: int):
        self.events, self.eos = events, eos
        self.reloaded: list[list[str]] = []  # weight names of each reload
        self.sampling: list[list] = []  # SamplingParams of each generate call

    def sleep(self, level):
        self.events.append(f"sleep level {level}")

    def wake_up(self, tags):
        self.events.append(f"wake_up {tags}")

    def collective_rpc(self, method, kwargs):
        assert kwargs["is_checkpoint_format"]
        self.reloaded.append([name for name, _ in kwargs["weights_iterator"]])
        self.events.append(method)

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")

    def generate(self, requests, params, use_tqdm):
        self.events.append("generate")
        self.sampling.append(params)
        sample = SimpleNamespace(token_ids=[self.eos], logprobs=[{self.eos: SimpleNamespace(logprob=-0.5)}])
        return [SimpleNamespace(outputs=[sample]) for _ in requests]


def fake_vllm(monkeypatch, reload_weights) -> None:
    """A stand-in ``vllm`` package with just what the engine imports; ``reload_weights`` is its model runner's."""
    modules = {name: ModuleType(name) for name in
               ["vllm", "vllm.inputs", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu_model_runner"]}
    modules["vllm"].__version__ = "0.0.fake"
    modules["vllm"].SamplingParams = SimpleNamespace
    modules["vllm.inputs"].TokensPrompt = dict
    modules["vllm.v1.worker.gpu_model_runner"].GPUModelRunner = type("GPUModelRunner", (), {"reload_weights": reload_weights})
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def reload_from_an_iterator(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
    """vLLM 0.32's ``GPUModelRunner.reload_weights`` signature."""


def reload_from_the_directory(self):
    """The ``reload_weights`` of a vLLM without in-place loading of given weights."""


def fake_engine(monkeypatch, events: list[str], sleep_mode: bool):
    from flowkit.llm.vllm_engine import VllmRolloutEngine

    fake_vllm(monkeypatch, reload_from_an_iterator)
    policy, tokenizer = load_backbone("bundled:tiny_adder")
    engine = VllmRolloutEngine(policy, tokenizer, "unused", max_new_tokens=4)
    engine.llm, engine.sleep_mode = FakeLLM(events, tokenizer.eos_token_id), sleep_mode  # as _build sets them
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    return engine


def test_a_vllm_without_in_place_reload_from_an_iterator_is_a_one_line_config_error(monkeypatch):
    fake_vllm(monkeypatch, reload_from_the_directory)
    with pytest.raises(ConfigError, match=r"^PolicyModule.rollout.engine 'vllm': vLLM 0\.0\.fake cannot load weights "
                                          r"handed over by the trainer .*flowkit\[vllm\]") as raised:
        PolicyModule(rollout=RolloutOptions(engine="vllm"))
    assert "\n" not in str(raised.value)


def test_sleep_mode_sleeps_at_level_2_and_wakes_weights_then_push_then_kv_cache(monkeypatch):
    """As TRL's colocate mode: level 2 after each generation (nothing copied to host), and each wake frees torch's
    cached blocks first, wakes the weights, pushes the policy into them, then wakes the KV cache. Level 2 releases
    the weights, so a generation without a training step before it (validation) pushes them again too."""
    events: list[str] = []
    engine = fake_engine(monkeypatch, events, sleep_mode=True)
    names = sorted(name for name, _ in engine.model.named_parameters(remove_duplicate=False))
    wake_push_generate = ["empty_cache", "wake_up ['weights']", "reload_weights", "reset_prefix_cache",
                          "empty_cache", "wake_up ['kv_cache']", "generate", "sleep level 2"]

    engine.generate(["1+1="], 2)  # first generation: vLLM awake, holding the directory's weights
    assert events == ["reload_weights", "reset_prefix_cache", "generate", "sleep level 2"]
    events.clear()
    engine.sync_weights(engine.model, 1)  # after a training step: nothing happens until the next generation
    assert events == []
    engine.generate(["1+1="], 2)
    assert events == wake_push_generate
    events.clear()
    engine.generate(["1+1="], 1, temperature=0)
    assert events == wake_push_generate
    assert [sorted(reloaded) for reloaded in engine.llm.reloaded] == [names] * 3


def test_without_sleep_mode_weights_are_pushed_once_per_training_step(monkeypatch):
    events: list[str] = []
    engine = fake_engine(monkeypatch, events, sleep_mode=False)
    engine.generate(["1+1="], 2)
    engine.sync_weights(engine.model, 2)
    engine.generate(["1+1="], 2)
    engine.generate(["1+1="], 2)  # no step since the last push
    assert events == ["reload_weights", "reset_prefix_cache", "generate"] * 2 + ["generate"]


class DrawingLLM(FakeLLM):
    """A fake ``vllm.LLM`` that samples as vLLM does a request without a seed of its own: from the process's global
    generators (torch's noise; NumPy's in vLLM's newer model runner, which draws a seed per such request)."""

    def __init__(self, events: list[str], eos: int):
        super().__init__(events, eos)
        self.draws: list[tuple[float, int]] = []

    def generate(self, requests, params, use_tqdm):
        self.draws.append((float(torch.rand(())), int(np.random.randint(2**31))))
        return super().generate(requests, params, use_tqdm)


def drawing_engine(monkeypatch, rank: int, world: int):
    """A fake engine on ``rank`` of ``world`` (the process group faked), built as the first generation builds it."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: world)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank)
    engine = fake_engine(monkeypatch, [], sleep_mode=False)
    engine.llm = DrawingLLM([], engine.tokenizer.eos_token_id)
    return engine


def samples_of(engine, seed: int, calls: int = 2) -> list[tuple[float, int]]:
    torch.manual_seed(seed)  # the run's seed, as seed_everything sets it on every rank
    for _ in range(calls):
        engine.generate(["1+1=", "2+2="], 4)
    return engine.llm.draws


def test_one_seed_per_engine_reproducible_distinct_over_ranks_and_apart_from_the_trainer_rng(monkeypatch):
    """Sampled requests carry no seed (vLLM then samples the batch together, not with one generator per request):
    the engine's stream is seeded once per rank from the run's seed. Same seed and rank → the same samples; another
    rank or seed → others; each generation continues the stream; the trainer's RNG streams are left as they were."""
    first = samples_of(drawing_engine(monkeypatch, rank=0, world=2), seed=0)
    assert samples_of(drawing_engine(monkeypatch, rank=0, world=2), seed=0) == first  # reproducible
    assert first[0] != first[1]  # the stream continues over generations
    other_rank = samples_of(drawing_engine(monkeypatch, rank=1, world=2), seed=0)
    other_seed = samples_of(drawing_engine(monkeypatch, rank=0, world=2), seed=1)
    assert not set(first) & set(other_rank) and not set(first) & set(other_seed)

    engine = drawing_engine(monkeypatch, rank=0, world=2)
    torch.manual_seed(0)
    np.random.seed(0)
    trainer_draws = (torch.rand(3), np.random.rand(3))
    torch.manual_seed(0)
    np.random.seed(0)
    engine.generate(["1+1="], 2)
    sampled = engine.llm.sampling[-1]
    engine.generate(["1+1="], 2, temperature=0)
    greedy = engine.llm.sampling[-1]
    assert torch.equal(torch.rand(3), trainer_draws[0]) and np.array_equal(np.random.rand(3), trainer_draws[1])
    assert sampled.n == 1 and sampled.temperature == 1.0 and "seed" not in vars(sampled)
    assert greedy.temperature == 0.0 and "seed" not in vars(greedy)
