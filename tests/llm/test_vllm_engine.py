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
from pathlib import Path

import lightning as L
import pytest
import torch

from flowkit.errors import ConfigError
from flowkit.llm.backbone import load_backbone, resolve_backbone_path
from flowkit.llm.lora import LoraSettings
from flowkit.llm.rollout import RolloutEngine, forward_logits
from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.rl.logprobs import token_logprobs

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
    engine = getattr(module_or_engine, "engine", module_or_engine)
    engine.llm = None
    gc.collect()


def recomputed_logprobs(model: torch.nn.Module, batch) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(forward_logits(model, batch), batch.input_ids) * batch.response_mask


def assert_synced(module: PolicyModule, initial: torch.nn.Module, prompts: list[str]) -> None:
    """vLLM samples the trained policy: greedy completions equal HF greedy generation with the trained weights,
    and its log-probs of its own samples match the trained policy's recomputation, not the initial policy's."""
    hf = RolloutEngine(module.policy, module.tokenizer, module.hparams.max_new_tokens)
    greedy_vllm = module.engine.generate(prompts, 1, temperature=0)
    greedy_hf = hf.generate(prompts, 1, temperature=0)
    assert greedy_vllm.responses == greedy_hf.responses
    assert torch.equal(greedy_vllm.input_ids, greedy_hf.input_ids)
    assert torch.equal(greedy_vllm.response_mask, greedy_hf.response_mask)

    sampled = module.engine.generate(prompts, 2, temperature=1.0)
    trained_gap = (sampled.rollout_logprobs - recomputed_logprobs(module.policy, sampled)).abs().max()
    stale_gap = (sampled.rollout_logprobs - recomputed_logprobs(initial, sampled)).abs().max()
    assert trained_gap < LOGPROB_TOLERANCE, trained_gap
    assert stale_gap > 100 * LOGPROB_TOLERANCE, stale_gap  # the 3 steps moved the weights: a stale copy would show


def test_missing_vllm_is_a_one_line_config_error():
    if HAS_VLLM:
        pytest.skip("vLLM is installed")
    with pytest.raises(ConfigError, match=r"^PolicyModule.rollout_engine 'vllm' needs vLLM .*pip install flowkit\[vllm\]"):
        PolicyModule(rollout_engine="vllm")


def test_unknown_rollout_engine_is_a_config_error():
    with pytest.raises(ConfigError, match="rollout_engine must be hf or vllm"):
        PolicyModule(rollout_engine="sglang")


@pytest.mark.parametrize("option, value", [("vllm_gpu_memory_utilization", 0.0), ("vllm_max_model_len", 0)])
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_bad_vllm_settings_are_config_errors(option, value):
    with pytest.raises(ConfigError, match=f"PolicyModule.{option}"):
        PolicyModule(rollout_engine="vllm", **{option: value})


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_layout_matches_hf_engine_and_sampler_logprobs_match_the_trainer(single_thread):
    from flowkit.llm.vllm_engine import VllmRolloutEngine

    torch.manual_seed(0)
    policy, tokenizer = load_backbone("bundled:tiny_adder")
    engine = VllmRolloutEngine(policy, tokenizer, resolve_backbone_path("bundled:tiny_adder"), max_new_tokens=28)
    hf = RolloutEngine(policy, tokenizer, max_new_tokens=28)
    prompts, answers = val_prompts(6)
    prompts[0] = "7+5="  # a shorter prompt, so rows are left-padded

    # Building the engine leaves the trainer's RNG streams where they were (vLLM seeds them in its constructor).
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    engine.sync_weights(policy)  # the first sync builds the engine
    assert engine.llm is not None and torch.equal(torch.rand(3), expected)

    # Greedy: the same RolloutBatch as HF generate, field by field.
    ours, theirs = engine.generate(prompts, 1, answers, temperature=0), hf.generate(prompts, 1, answers, temperature=0)
    for name in ["input_ids", "attention_mask", "response_mask", "group_ids"]:
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert (ours.responses, ours.prompts, ours.answers) == (theirs.responses, theirs.prompts, theirs.answers)
    assert (ours.attention_mask[:, 0] == 0).any()  # left padding was exercised

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
    module = PolicyModule(num_samples=4, max_new_tokens=28, outcome_reward="binary", rollout_engine="vllm",
                          rollout_is_cap=2.0, **options)
    data = RolloutDataModule(batch_size=4, val_path=None)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, data)
    return module


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_lora_weights_are_merged_into_vllm_after_three_rl_steps(tmp_path, single_thread):
    module = fit_policy(tmp_path, lora=LoraSettings(r=8, alpha=16), lr=2e-2)
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
        "--trainer.enable_progress_bar", "false", "--model.init_args.rollout_engine", "vllm",
        "--model.init_args.rollout_is_cap", "2.0", "--model.init_args.lr", "1e-3",
        "--model.init_args.flow_pretrain_steps", "3", "--model.init_args.reward_model.init_args.kappa", "4",
        "--data.init_args.batch_size", "4", "--model.init_args.num_samples", "4",
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
    sent = {name: weight.clone() for name, weight in policy_weights(model)}
    assert sent.keys() == expected.keys(), sorted(set(sent) ^ set(expected))
    for name, weight in expected.items():
        torch.testing.assert_close(sent[name], weight, rtol=0, atol=1e-6, msg=name)
    print("gathered", kind, len(sent))
"""


@pytest.mark.slow
def test_sync_gathers_zero3_partitioned_weights():
    """Under ZeRO-3 the parameters are empty shards; the sync gathers each module's and sends full weights,
    for full fine-tuning and LoRA (one rank here: GatheredParameters is the same collective with more ranks)."""
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    code = f"TESTS = {str(Path(__file__).parent)!r}\n" + ZERO3_JOB
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gathered full" in result.stdout and "gathered lora" in result.stdout


TWO_RANK_JOB = """
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
from flowkit.llm.backbone import load_backbone, resolve_backbone_path
from flowkit.llm.rollout import RolloutEngine
from flowkit.llm.vllm_engine import VllmRolloutEngine
policy, tokenizer = load_backbone("bundled:tiny_adder")
engine = VllmRolloutEngine(policy, tokenizer, resolve_backbone_path("bundled:tiny_adder"), max_new_tokens=28)
prompts = ["47+38=", "12+13="] if dist.get_rank() == 0 else ["55+21=", "9+9="]
before = engine.generate(prompts, 1, temperature=0).responses
torch.manual_seed(dist.get_rank())
with torch.no_grad():
    for param in policy.parameters():
        param.add_(torch.randn_like(param), alpha=0.02)
engine.sync_weights(policy)
after = engine.generate(prompts, 1, temperature=0).responses
assert after == RolloutEngine(policy, tokenizer, 28).generate(prompts, 1, temperature=0).responses, after
assert after != before
print("rank", dist.get_rank(), "synced", flush=True)
"""


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_one_engine_per_rank_in_the_trainers_process_group(tmp_path):
    """Two ranks (gloo), each with its own colocated engine joining the existing process group (vLLM's
    external launcher); each rank's sync reaches its own engine."""
    import subprocess
    import sys

    job = tmp_path / "two_ranks.py"
    job.write_text(TWO_RANK_JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(job)], env=env, capture_output=True, text=True, timeout=300)
    assert "rank 0 synced" in result.stdout and "rank 1 synced" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
