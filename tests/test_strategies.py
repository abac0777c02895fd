"""DeepSpeed ZeRO on CPU through Lightning (flowkit.strategies), on a stand-in module with the policy's shape:
policy and flow parameter groups with different learning rates in ONE optimizer.

Each DeepSpeed run is a subprocess (tests/tiny_zero_job.py): Lightning relaunches the script per rank,
and a DeepSpeed process group lives as long as its process. Results are compared with the same
training written in plain PyTorch.
"""

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import rlfr_run
import tiny_zero_job
import torch
from lightning.pytorch.strategies import StrategyRegistry
from safetensors.torch import load_file

from flowkit.checkpointing.safe_loading import consolidated_state_dict, load_trained_weights
from flowkit.strategies import (
    CPUDeepSpeedStrategy,
    FlowkitDeepSpeedStrategy,
    _as_cpu_adam,
)

ROOT = Path(__file__).resolve().parent.parent
JOB = Path(tiny_zero_job.__file__)


def run_job(tmp_path: Path, name: str, *args: str) -> Path:
    out = tmp_path / name
    result = subprocess.run([sys.executable, str(JOB), "--out", str(out), *args], env=rlfr_run.env(), cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def reference_weights(optimizer: str, steps: int) -> dict[str, torch.Tensor]:
    """The same training in plain PyTorch, one process, each step on the whole (4-sample) dataset.

    Every DeepSpeed run here also sees the whole dataset per step — one batch of 4, or 2 per rank on 2
    ranks — so Lightning's data order (it always shuffles under distributed strategies, and reorders
    epochs on resume) changes only the summation order.
    """
    module = tiny_zero_job.initial_module(optimizer)
    opt = module.configure_optimizers()
    x, y = tiny_zero_job.dataset().tensors
    for _ in range(steps):
        opt.zero_grad()
        module.loss(x, y).backward()
        opt.step()
    return {name: p.detach() for name, p in module.named_parameters()}


def load(out: Path, kind: str, rank: int = 0) -> dict:
    return torch.load(out / f"{kind}_rank{rank}.pt", weights_only=True)


def assert_weights_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, msg=lambda m, name=name: f"{name}: {m}")


def assert_both_groups_moved(weights: dict) -> None:
    start = dict(tiny_zero_job.initial_module("sgd").named_parameters())
    for prefix in ("policy.", "flow."):
        assert any(not torch.equal(w, start[n]) for n, w in weights.items() if n.startswith(prefix)), prefix


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero2.json", "zero3.json"])
def test_single_process_zero_trains_saves_and_resumes(tmp_path, config):
    """2 steps, save a (sharded) checkpoint, resume into a fresh module to 4 steps: equals plain AdamW."""
    checkpoint = tmp_path / "ckpt"
    out = run_job(tmp_path, "out", "--config", config, "--optimizer", "adamw", "--steps", "2",
                  "--save", str(checkpoint), "--resume-steps", "4")

    first = load(out, "weights")
    assert first["global_step"] == 2
    assert_both_groups_moved(first["weights"])
    assert_weights_close(first["weights"], reference_weights("adamw", 2))

    resumed = load(out, "resumed")
    assert resumed["global_step"] == 4
    # The fresh module started from other weights and optimizer moments: equality means both came back.
    assert_weights_close(resumed["weights"], reference_weights("adamw", 4))

    shards = sorted(p.name for p in (checkpoint / "checkpoint").iterdir())
    if config == "zero3.json":
        assert shards == ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
        # A ZeRO-3 checkpoint holds no full weights; the export path consolidates the shards.
        assert_weights_close(consolidated_state_dict(checkpoint), first["weights"])


@pytest.mark.slow
def test_two_processes_average_gradients(tmp_path):
    """ZeRO-2, devices=2 on CPU, 2 samples per rank, SGD: both ranks hold the full-batch weights."""
    out = run_job(tmp_path, "out", "--config", "zero2.json", "--devices", "2", "--batch-size", "2", "--steps", "2")
    rank0, rank1 = load(out, "weights", 0), load(out, "weights", 1)
    assert rank0["world_size"] == rank1["world_size"] == 2
    for name, weight in rank0["weights"].items():
        assert torch.equal(weight, rank1["weights"][name]), name
    assert_both_groups_moved(rank0["weights"])
    # Averaged (not summed, not rank-local) gradients give exactly the full-batch update.
    assert_weights_close(rank0["weights"], reference_weights("sgd", 2))


def test_strategies_are_registered():
    for name, stage in [("deepspeed_cpu_stage_2", 2), ("deepspeed_cpu_stage_3", 3), ("deepspeed_cpu_stage_3_offload", 3)]:
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, CPUDeepSpeedStrategy)
        assert strategy.config["zero_optimization"]["stage"] == stage
    offload = StrategyRegistry.get("deepspeed_stage_3_offload_cpuadam")
    assert type(offload) is FlowkitDeepSpeedStrategy and offload._offloads_optimizer()


def test_cpu_strategy_refuses_other_accelerators():
    from lightning.pytorch.accelerators import CUDAAccelerator

    strategy = CPUDeepSpeedStrategy(stage=2, accelerator=CUDAAccelerator())
    with pytest.raises(TypeError, match="runs on the CPU accelerator"):
        strategy.setup_environment()


@pytest.mark.parametrize("config", sorted((ROOT / "configs" / "deepspeed").glob("*.json")), ids=lambda p: p.name)
def test_deepspeed_configs_parse(config):
    strategy = CPUDeepSpeedStrategy(config=str(config))
    assert strategy.config["zero_optimization"]["stage"] in (2, 3)
    assert strategy._offloads_optimizer() == ("offload" in config.name)


@pytest.mark.parametrize("config", sorted((ROOT / "configs" / "deepspeed").glob("*.json")), ids=lambda p: p.name)
def test_deepspeed_configs_accumulate_bf16_gradients_in_fp32(config):
    """Each shipped config, as Lightning hands it to DeepSpeed under ``bf16-mixed``, parsed by DeepSpeed's own config
    class: the engine's (model, accumulation) dtypes — what it passes to the ZeRO-2/3 optimizers as
    ``gradient_accumulation_dtype`` (their gradient partitions' dtype) — are (bf16, fp32). Without ``data_types``
    DeepSpeed accumulates in the model dtype: a step's ~32 micro-batches and flow pieces summed in bf16."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine
    from lightning.fabric.strategies.deepspeed import _format_precision_config

    settings = json.loads(config.read_text())
    settings["train_micro_batch_size_per_gpu"] = 1  # Lightning sets it from the loader
    _format_precision_config(settings, "bf16-mixed", loss_scale=0, loss_scale_window=1000, min_loss_scale=1,
                             initial_scale_power=16, hysteresis=2)
    engine = types.SimpleNamespace(_config=DeepSpeedConfig(settings))
    engine.fp16_enabled = types.MethodType(DeepSpeedEngine.fp16_enabled, engine)
    engine.bfloat16_enabled = types.MethodType(DeepSpeedEngine.bfloat16_enabled, engine)
    assert DeepSpeedEngine.get_data_types(engine) == (torch.bfloat16, torch.float32)


def test_offload_turns_adamw_into_cpu_adam_with_same_groups():
    pytest.importorskip("deepspeed.ops.adam")
    module = tiny_zero_job.initial_module("adamw")
    optimizer = module.configure_optimizers()
    try:
        converted = _as_cpu_adam(optimizer)
    except (ImportError, OSError, RuntimeError) as err:  # the op is JIT-compiled: needs a C++ compiler
        pytest.skip(f"DeepSpeedCPUAdam is not buildable here: {err}")
    assert type(converted).__name__ == "DeepSpeedCPUAdam"
    assert [g["lr"] for g in converted.param_groups] == [0.05, 0.1]
    assert [g["params"] for g in converted.param_groups] == [g["params"] for g in optimizer.param_groups]
    assert converted.adam_w_mode
    with pytest.raises(TypeError, match="converts Adam/AdamW"):
        _as_cpu_adam(torch.optim.SGD(module.parameters(), lr=0.1))


# ---------------------------------------------------------------------------------------------------
# The tiny RLFR job (PolicyModule: policy + flow groups in one optimizer) under DeepSpeed, via the CLI.


def zero_config(tmp_path: Path, stage: int) -> Path:
    """The shipped config; for ZeRO-3 every parameter is partitioned (DeepSpeed keeps parameters under
    1e5 elements whole by default, which is all of the tiny model)."""
    config = json.loads((ROOT / "configs" / "deepspeed" / f"zero{stage}.json").read_text())
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = tmp_path / f"zero{stage}.json"
    path.write_text(json.dumps(config))
    return path


def deepspeed_args(tmp_path: Path, stage: int, devices: int = 1) -> list[str]:
    return ["--trainer.devices", str(devices), "--trainer.strategy", "flowkit.strategies.CPUDeepSpeedStrategy",
            "--trainer.strategy.config", str(zero_config(tmp_path, stage))]


def run_rlfr(tmp_path: Path, stage: int, devices: int = 1, *extra: str, steps: int = 2) -> list[dict[str, torch.Tensor]]:
    rlfr_run.run(tmp_path, steps, *deepspeed_args(tmp_path, stage, devices),
                 "--trainer.callbacks+=rank_weights.RankWeights", "--trainer.callbacks.out", str(tmp_path / "weights"),
                 *extra)
    return [load_file(str(tmp_path / "weights" / f"rank{rank}.safetensors")) for rank in range(devices)]


def end_weights(snapshot: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(f"end/{prefix}"): v for k, v in snapshot.items() if k.startswith(f"end/{prefix}")}


def assert_policy_and_flow_changed(snapshot: dict[str, torch.Tensor]) -> None:
    for prefix in ("policy.", "reward_model."):
        names = [k.removeprefix("start/") for k in snapshot if k.startswith(f"start/{prefix}")]
        assert names, prefix
        assert any(not torch.equal(snapshot[f"start/{n}"], snapshot[f"end/{n}"]) for n in names), f"{prefix} unchanged"


def assert_exported(directory: Path, snapshot: dict[str, torch.Tensor]) -> None:
    """hf_policy/ and flow.safetensors hold exactly the trained weights (whole, not ZeRO-3 shards)."""
    flow = load_file(str(directory / "flow.safetensors"))
    assert_weights_close(flow, end_weights(snapshot, "reward_model.field."))
    policy = {}
    for shard in (directory / "hf_policy").glob("*.safetensors"):
        policy |= load_file(str(shard))
    expected = end_weights(snapshot, "policy.")
    assert policy and set(policy) <= set(expected)
    assert_weights_close(policy, {k: expected[k] for k in policy})


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_rlfr_trains_saves_and_resumes_under_zero_in_one_process(tmp_path, stage):
    (snapshot,) = run_rlfr(tmp_path, stage)
    assert_policy_and_flow_changed(snapshot)
    version = rlfr_run.version_dirs(tmp_path)[-1]
    assert_exported(version / "export", snapshot)  # the ExportArtifacts callback at the end of fit
    # `--ckpt_path last` finds the (sharded) DeepSpeed checkpoint and continues at step 2.
    rlfr_run.run(tmp_path, 3, *deepspeed_args(tmp_path, stage), "--ckpt_path", "last")
    assert sorted(rlfr_run.metrics(rlfr_run.version_dirs(tmp_path)[-1])) == [3]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_rlfr_two_processes_keep_ranks_identical(tmp_path, stage):
    """Each rank draws its own prompts (and ZeRO-3 shards the weights), yet both end with the same weights."""
    rank0, rank1 = run_rlfr(tmp_path, stage, devices=2)
    assert_policy_and_flow_changed(rank0)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    assert_exported(rlfr_run.version_dirs(tmp_path)[-1] / "export", rank0)  # ExportArtifacts on 2 ranks
    if stage == 3:
        # The documented command turns the 2-rank sharded checkpoint into the trained artifacts.
        checkpoint = tmp_path / "runs" / "rlfr_tiny" / "checkpoints" / "last.ckpt"
        assert len(list((checkpoint / "checkpoint").glob("zero_pp_rank_*_optim_states.pt"))) == 2
        out = tmp_path / "exported"
        result = subprocess.run(
            [shutil.which("flowkit") or "flowkit", "export", "--config", str(rlfr_run.CONFIG),
             "--checkpoint", str(checkpoint), "--out", str(out)],
            env=rlfr_run.env(), cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert_exported(out, rank0)


def test_export_reads_plain_checkpoints_and_names_bad_paths(tmp_path):
    module = tiny_zero_job.initial_module("sgd")
    torch.save({"state_dict": module.state_dict(), "global_step": 3}, tmp_path / "plain.ckpt")
    fresh = tiny_zero_job.TwoGroupModule()
    load_trained_weights(fresh, tmp_path / "plain.ckpt")
    assert_weights_close(dict(fresh.named_parameters()), dict(module.named_parameters()))

    torch.save({"state_dict": {k: v for k, v in module.state_dict().items() if k != "flow.bias"}}, tmp_path / "part.ckpt")
    with pytest.raises(KeyError, match="no weights for 1 trainable parameter"):
        load_trained_weights(fresh, tmp_path / "part.ckpt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        consolidated_state_dict(tmp_path / "missing.ckpt")
    with pytest.raises(FileNotFoundError, match="not a DeepSpeed checkpoint"):
        consolidated_state_dict(tmp_path)


@pytest.mark.slow
def test_rlfr_zero3_two_processes_with_correctness_rejection(tmp_path):
    """Ranks accept different numbers of correct rollouts; the flow step is still taken by all ranks together
    (the smallest buffer decides), so ZeRO-3's collectives stay in step and the ranks end identical."""
    rank0, rank1 = run_rlfr(tmp_path, 3, 2, "--model.init_args.reward_model.init_args.online.rejection_metric", "correct",
                            "--model.init_args.reward_model.init_args.online.kappa", "3")
    assert_policy_and_flow_changed(rank0)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_flow_moves_only_on_the_minibatch_that_carries_its_loss(tmp_path, stage):
    """One RL step, 2 epochs × 2 minibatches, one flow update (in the first minibatch). A single AdamW step
    moves a weight by at most lr; DeepSpeed steps every group each minibatch, so without
    flowkit.modules.optim.step_groups the flow kept moving on momentum (and stale gradients) three more times."""
    flow_lr = 1e-3
    (snapshot,) = run_rlfr(tmp_path, stage, 1, "--model.init_args.update.ppo_epochs", "2", "--model.init_args.update.num_minibatches",
                           "2", "--model.init_args.optim.flow_lr", str(flow_lr), steps=1)
    moved = max((snapshot[f"end/{n}"] - snapshot[f"start/{n}"]).abs().max().item()
                for n in (k.removeprefix("start/") for k in snapshot if k.startswith("start/reward_model.")))
    assert 0.5 * flow_lr < moved <= flow_lr * (1 + 1e-4), moved


def relative_update_error(run: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], prefix: str) -> float:
    """‖Δrun − Δref‖ / ‖Δref‖ over one parameter group, Δ = end − start weights."""
    names = sorted(k.removeprefix("start/") for k in reference if k.startswith(f"start/{prefix}"))
    delta = lambda s: torch.cat([(s[f"end/{n}"] - s[f"start/{n}"]).flatten() for n in names])  # noqa: E731
    want = delta(reference)
    return float((delta(run) - want).norm() / want.norm())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_micro_batches_accumulate_gradients_under_zero(tmp_path, stage):
    """Several backward calls before one optimizer step really accumulate under DeepSpeed: 2 RL steps with
    micro-batches of 3 sequences (6 policy + flow backward passes per step) move policy and flow as one
    whole-batch backward does (in a ZeRO-2 that kept only the last micro-batch's gradients they would not)."""
    (tmp_path / "whole").mkdir()
    (tmp_path / "micro").mkdir()
    (whole,) = run_rlfr(tmp_path / "whole", stage)
    (micro,) = run_rlfr(tmp_path / "micro", stage, 1, "--model.init_args.update.micro_batch_size", "3")
    for prefix in ("policy.", "reward_model."):
        assert relative_update_error(micro, whole, prefix) < 1e-3, prefix


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_explanation_ppo_and_sft_micro_batches_accumulate_under_zero(tmp_path, stage):
    """The explanation job (explain_tiny.yaml: LoRA, GAE with a value head, the KL in the reward, 2 PPO epochs)
    with an SFT start, under DeepSpeed: micro-batches of 3 sequences, in the SFT steps and in the PPO updates, move
    LoRA and the value head as whole batches do (the accumulation handling is RLFR's, through the same engine)."""
    shrunk = ["--config", str(ROOT / "configs" / "explain_tiny.yaml"), *deepspeed_args(tmp_path, stage),
              "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
              "--trainer.callbacks.rounds", "1", "--trainer.callbacks.policy_epochs_per_round", "1",
              "--model.init_args.sft.epochs", "1",
              "--model.init_args.reward_model.init_args.flow_epochs_per_round", "2",
              "--model.init_args.reward_model.init_args.round_contexts", "8",
              "--model.init_args.reward_model.init_args.heldout_contexts", "4",
              "--data.init_args.num_train", "8", "--data.init_args.num_test", "4",
              "--trainer.callbacks+=rank_weights.RankWeights"]
    runs = {}
    for name, extra in {"whole": [], "micro": ["--model.init_args.update.micro_batch_size", "3"]}.items():
        root = tmp_path / name
        root.mkdir()
        result = subprocess.run(
            [shutil.which("flowkit") or "flowkit", "fit", *shrunk, "--trainer.callbacks.out", str(root / "weights"),
             "--trainer.default_root_dir", str(root / "run"), *extra],
            env=rlfr_run.env(), cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = load_file(str(root / "weights" / "rank0.safetensors"))
        sft = rlfr_run.metrics(next((root / "run").glob("version_*")))
        assert any("sft/loss" in values for values in sft.values())
    lora = [k.removeprefix("start/") for k in runs["whole"] if k.startswith("start/policy.") and "lora_" in k]
    assert lora and any(not torch.equal(runs["whole"][f"start/{n}"], runs["whole"][f"end/{n}"]) for n in lora)
    for prefix in ("policy.", "value_head."):
        assert relative_update_error(runs["micro"], runs["whole"], prefix) < 1e-3, prefix
