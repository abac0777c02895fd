"""PolicyModule end to end on the bundled tiny task (the README's main job, shortened where it can be)."""

import csv
import json
from pathlib import Path

import pytest
import torch

from flowkit.cli import FlowkitCLI, main
from flowkit.llm.lora import LoraSettings
from flowkit.modules import PolicyModule
from flowkit.modules.policy_options import (
    AdvantageOptions, FlowPretrainOptions, LossOptions, OptimOptions, RolloutOptions, SamplingControls, SamplingOptions,
    SFTOptions, UpdateOptions, ValidationOptions,
)
from flowkit.rl.rollout_correction import RolloutCorrection

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "rlfr_tiny.yaml")


def run_fit(tmp_path: Path, monkeypatch, *overrides: str) -> list[dict[str, str]]:
    """`flowkit fit` on the tiny config inside ``tmp_path`` (its runs/ paths are relative to the working dir)."""
    monkeypatch.chdir(tmp_path)
    cli = FlowkitCLI(args=["fit", "--config", CONFIG, *overrides])
    with open(Path(cli.trainer.logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key)]


def test_short_run_logs_every_metric_and_writes_artifacts(tmp_path, monkeypatch):
    rows = run_fit(tmp_path, monkeypatch, "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
                   "--model.init_args.flow_pretrain.steps", "3", "--data.init_args.max_val_examples", "16",
                   "--model.init_args.reward_model.init_args.online.kappa", "4")
    logged = {k for r in rows for k, v in r.items() if v}
    for key in ["train/outcome_reward", "train/accuracy", "flow/reward_mean", "flow/reward_nonzero_frac", "flow/loss",
                "train/policy_loss", "train/clip_fraction", "train/entropy", "train/response_length",
                "train/tokens_per_s", "val/heldout/pass@1", "val/heldout/pass@4"]:
        assert key in logged, key
    run_dir = next(tmp_path.glob("runs/rlfr_tiny/version_*"))
    ckpt = tmp_path / "runs/rlfr_tiny/checkpoints/last.ckpt"
    assert ckpt.is_file()
    for artifact in ["config.yaml", "metrics.csv", "export/flow.safetensors",
                     "export/hf_policy/model.safetensors", "export/hf_policy/tokenizer.json"]:
        assert (run_dir / artifact).is_file(), artifact

    # `flowkit score` on the run's checkpoint: one reward per response token, written as JSONL and HTML.
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "47+38=", "response": "7+8=15,4+3+1=8\\boxed{85}"}) + "\n"
                     + json.dumps({"prompt": "12+13=", "response": "2+3=5,1+1=2\\boxed{25}"}) + "\n")
    out, page = tmp_path / "scores.jsonl", tmp_path / "scores.html"
    main(["score", "--config", CONFIG, "--checkpoint", str(ckpt),
          "--input", str(pairs), "--output", str(out), "--html_output", str(page)])
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(scored) == 2
    for row in scored:
        assert "".join(row["tokens"][:-1]) == row["response"]  # characters, then <eos>
        assert len(row["rewards"]) == len(row["tokens"]) == len(row["deviations"])
        assert all(r <= 0 for r in row["rewards"]) and any(r < 0 for r in row["rewards"])
    assert page.read_text().count("<span style") == sum(len(r["tokens"]) for r in scored)


def test_lora_trains_only_adapters_in_the_policy_group(tmp_path):
    module = PolicyModule(lora=LoraSettings(r=4, alpha=8))
    groups = {g["name"]: g for g in module.configure_optimizers().param_groups}
    assert set(groups) == {"policy"}
    trainable = [n for n, p in module.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    paths = module.export_artifacts(tmp_path)
    assert (paths["policy"] / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_rl_improves_outcome_reward(tmp_path, monkeypatch):
    """Convergence on the tiny task (fixed seed): the last 10 RL steps beat the first 10 clearly."""
    torch.use_deterministic_algorithms(True)
    try:
        rows = run_fit(tmp_path, monkeypatch, "--trainer.limit_val_batches", "0")
    finally:
        torch.use_deterministic_algorithms(False)
    rewards = column(rows, "train/outcome_reward")
    assert len(rewards) == 60
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.05, (first, last)


def test_max_grad_norm_becomes_deepspeeds_gradient_clipping():
    """Lightning's clip_gradients is a no-op under DeepSpeed; the module hands its clip norm to the engine config."""
    import lightning as L

    from flowkit.strategies import CPUDeepSpeedStrategy

    def trainer(config: dict) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=1, strategy=CPUDeepSpeedStrategy(config=config), logger=False,
                         enable_checkpointing=False)

    module = PolicyModule(optim=OptimOptions(max_grad_norm=0.5), flow_pretrain=FlowPretrainOptions(steps=0))
    module.trainer = trainer({"zero_optimization": {"stage": 2}})
    module.setup("fit")
    assert module.trainer.strategy.config["gradient_clipping"] == 0.5
    module.trainer = trainer({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0})
    with pytest.raises(ValueError, match="gradient_clipping 1.0"):
        module.setup("fit")


def test_rollouts_generated_in_chunks_equal_one_call_when_greedy():
    module = PolicyModule(sampling=SamplingOptions(num_samples=1, max_new_tokens=12),
                          rollout=RolloutOptions(batch_size=2))
    prompts, answers = ["47+38=", "12+13=", "5+6="], ["85", "25", "11"]
    chunked = module.rollout_engine.generate(prompts, 1, answers, temperature=0)  # calls of 2 and 1 prompts
    module.rollout_engine.rollout_batch_size = None
    whole = module.rollout_engine.generate(prompts, 1, answers, temperature=0)
    assert chunked.responses == whole.responses and chunked.answers == whole.answers
    assert chunked.group_ids.tolist() == [0, 1, 2]
    assert torch.equal(chunked.response_lengths, whole.response_lengths)


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampling", "greedy"])
def test_nan_weights_skip_in_generation_then_fail_after_max_consecutive_skips(tmp_path, caplog, temperature):
    """NaN weights (here turned NaN after the start's check) used to crash inside HF generate (sampling) or skip
    forever (greedy); now each step is skipped by the ``nonfinite`` policy and the run fails with the reason after
    ``max_consecutive_skips``."""
    import lightning as L

    from flowkit.modules import RolloutDataModule

    class NanNorm(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            with torch.no_grad():
                pl_module.policy.model.norm.weight.fill_(float("nan"))

    module = PolicyModule(sampling=SamplingOptions(num_samples=1 if temperature == 0 else 2, max_new_tokens=8,
                                                   temperature=temperature),
                          optim=OptimOptions(max_consecutive_skips=3))
    trainer = L.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[NanNorm()])
    with pytest.raises(FloatingPointError, match="3 RL steps in a row were skipped .* non-finite generation logits"):
        trainer.fit(module, RolloutDataModule(batch_size=2, val_path=None))
    assert module.guard.skipped_steps == 3 and trainer.global_step == 0
    assert "skipping RL step 1: non-finite generation logits" in caplog.text


@pytest.mark.parametrize("groups, message", [
    ({"update": UpdateOptions(micro_batch_size=0)}, r"^PolicyModule.update.micro_batch_size must be >= 1, got 0$"),
    ({"rollout": RolloutOptions(batch_size=12)},
     r"^PolicyModule.rollout.batch_size must be a positive multiple of sampling.num_samples \(8\)"),
    ({"loss": LossOptions(clip_ratio_c=1.0)}, r"^PolicyModule.loss.clip_ratio_c must be > 1"),
    ({"loss": LossOptions(aggregation="sum")},
     r"^PolicyModule.loss.aggregation must be one of token-mean, seq-mean, dr-grpo, got .sum.$"),
    ({"advantage": AdvantageOptions(scale_rewards="std")},
     r"^PolicyModule.advantage.scale_rewards must be one of group, batch, none, got .std.$"),
    ({"update": UpdateOptions(lm_head_chunk_size=0)}, r"^PolicyModule.update.lm_head_chunk_size must be >= 1"),
    ({"loss": LossOptions(rollout_correction=RolloutCorrection(mode="token_tis", cap=0.0))},
     r"^PolicyModule.loss.rollout_correction.cap must be > 0"),
    ({"loss": LossOptions(rollout_correction=RolloutCorrection(mode="tis"))},
     r"^PolicyModule.loss.rollout_correction.mode must be one of token_tis, seq_tis, token_mis"),
    ({"loss": LossOptions(rollout_correction=RolloutCorrection(mode="icepop", floor=6.0))},
     r"^PolicyModule.loss.rollout_correction.floor \(6.0\) must be below cap \(5.0\)"),
    ({"loss": LossOptions(rollout_correction=RolloutCorrection(mode="token_tis", bypass=True))},
     r"^PolicyModule.loss.rollout_correction.bypass takes the rollout's"),
    ({"optim": OptimOptions(max_consecutive_skips=0)}, r"^PolicyModule.optim.max_consecutive_skips must be >= 1"),
    ({"optim": OptimOptions(nonfinite="ignore")}, r"^PolicyModule.optim.nonfinite must be one of skip, fail, got"),
    ({"controls": SamplingControls(dynamic_sampling_max_draws=0)},
     r"^PolicyModule.controls.dynamic_sampling_max_draws must be >= 1"),
    ({"controls": SamplingControls(overlong_buffer_length=2000)},
     r"^PolicyModule.controls.overlong_buffer_length must be <= sampling.max_new_tokens \(1024\), got 2000$"),
    ({"controls": SamplingControls(overlong_buffer_length=8, overlong_penalty=-1.0)},
     r"^PolicyModule.controls.overlong_penalty must be >= 0"),
    ({"sampling": SamplingOptions(num_samples=2, temperature=0.0)},
     r"^PolicyModule.sampling.temperature 0 \(greedy\) makes the 2 samples"),
    ({"flow_pretrain": FlowPretrainOptions(steps=3)}, r"^PolicyModule.flow_pretrain.steps 3 needs a reward_model"),
    ({"flow_pretrain": FlowPretrainOptions(lr_decay="linear")},
     r"^PolicyModule.flow_pretrain.lr_decay must be one of cosine, constant, got 'linear'$"),
    ({"validation": ValidationOptions(num_samples=0)}, r"^PolicyModule.validation.num_samples must be >= 1"),
    ({"sft": SFTOptions(lr=0.0)}, r"^PolicyModule.sft.lr must be > 0"),
    ({"rollout": RolloutOptions(engine="sglang")}, r"^PolicyModule.rollout.engine must be one of hf, vllm, server"),
])
def test_option_groups_are_checked_before_the_backbone_loads(monkeypatch, groups, message):
    from flowkit.errors import ConfigError
    from flowkit.modules import policy

    monkeypatch.setattr(policy, "load_backbone", lambda *a: pytest.fail("loaded the backbone"))
    with pytest.raises(ConfigError, match=message):
        PolicyModule(**groups)
