"""ExplanationPolicyModule under DeepSpeed ZeRO-3 on CPU (``deepspeed_cpu_stage_3``), the paper's setting.

Under ZeRO-3 every rank holds only shards of the parameters outside their modules' forwards, yet the flow
reads the frozen last layer's W_Q/W_K/W_V as tensors. The run is a subprocess — this file as a script —
as in tests/test_strategies.py: Lightning relaunches the script per rank, and a DeepSpeed process group
lives as long as its process. The test then recomputes, in this plain process, the flow reward from the
run's final weights and compares it with the one computed under ZeRO-3. Under ZeRO-3 every forward,
backward and step is a collective, so ranks that accept different numbers of explanations must still do
the same collective work; a run whose ranks fall out of step hangs, which the subprocess timeout turns
into a failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import rlfr_run
import torch
from rank_weights import snapshot
from test_explanation import _data, _policy
from test_strategies import zero_config

from flowkit.explain.prompts import explanation_prompt
from flowkit.explain.reward_model import explanation_inputs
from flowkit.explain.sentence_rewards import SentenceRewards
from flowkit.llm.rollout import encode_pairs
from flowkit.modules import explanation
from flowkit.strategies import CPUDeepSpeedStrategy

ROUNDS = 2  # the second round's flow phase follows a PPO step
PROBE_ROWS = 4
PROBE_SEED = 7

pytestmark = pytest.mark.usefixtures("single_thread")


def flow_reward(module, rows: list[dict]) -> SentenceRewards:
    """The module's flow reward for the data's reference explanations of ``rows``, from fixed z0 draws."""
    batch = encode_pairs(module.tokenizer, [explanation_prompt(r["context"]) for r in rows],
                         [r["explanation"] for r in rows]).to(module.device)
    decisions = torch.tensor([r["decision"] for r in rows], device=module.device)
    return module.reward_model.sentence_rewards(module._flow_backbone, explanation_inputs(batch, module.tokenizer),
                                                decisions, torch.Generator().manual_seed(PROBE_SEED))


def trainable(trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
    names = {name for name, p in module.named_parameters() if p.requires_grad}
    return {name: weight for name, weight in snapshot(trainer, module).items() if name in names}


def rank_output(out: Path, rank: int) -> Path:
    return out.with_suffix(f".rank{rank}.pt")


class Probe(L.Callback):
    """Every rank saves the trainable weights at every phase boundary, the final weights, its logged metrics
    and the flow reward of the probe rows computed under ZeRO-3 (outside any forward, like a round's flow
    phase)."""

    def __init__(self, out: Path):
        self.out = out
        self.phases: dict[str, dict[str, torch.Tensor]] = {}

    def on_train_epoch_start(self, trainer, module):  # callbacks run first: before the round's flow phase
        self.phases[f"{trainer.current_epoch}/start"] = trainable(trainer, module)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 0:  # the flow phase is over, PPO starts
            self.phases[f"{trainer.current_epoch}/flow_trained"] = trainable(trainer, module)

    def on_train_epoch_end(self, trainer, module):
        self.phases[f"{trainer.current_epoch}/end"] = trainable(trainer, module)

    def on_train_end(self, trainer, module):  # every rank: gathering weights is a collective
        reward = flow_reward(module, trainer.datamodule.test_records[:PROBE_ROWS])
        weights = snapshot(trainer, module)
        metrics = {key: float(value) for key, value in trainer.logged_metrics.items()}
        torch.save({"reward": vars(reward), "weights": weights, "phases": self.phases, "metrics": metrics,
                    "world_size": trainer.world_size}, rank_output(self.out, trainer.global_rank))


def reject_all() -> None:
    """Rejection sampling keeps nothing: neither a round's flow pairs nor any held-out positive."""
    keep = explanation.rejection_mask
    explanation.rejection_mask = lambda logits, target: torch.zeros_like(keep(logits, target))


def sentence_per_token() -> None:
    """Every explanation token ends a sentence: many more prefixes for the proxy reward to score."""
    inputs_of = explanation.explanation_inputs

    def every_token_ends_a_sentence(batch, tokenizer):
        inputs = inputs_of(batch, tokenizer)
        inputs.sentence_ends = [list(range(1, ends[-1] + 1)) for ends in inputs.sentence_ends]
        return inputs

    explanation.explanation_inputs = every_token_ends_a_sentence


RANK_HOOKS = {"reject-all": reject_all, "sentence-per-token": sentence_per_token}


class PatchRank(L.Callback):
    """Test hook: one rank's module sees different data from the others (see RANK_HOOKS)."""

    def __init__(self, rank: int, hook: str):
        self.rank, self.hook = rank, hook

    def setup(self, trainer, module, stage):
        if trainer.global_rank == self.rank:
            RANK_HOOKS[self.hook]()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True, help="DeepSpeed config")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reward", default="flow")
    parser.add_argument("--rank-1-hook", choices=sorted(RANK_HOOKS), help="test hook applied on rank 1 only")
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    module = _policy(reward=args.reward)
    callbacks = [Probe(args.out)]
    if args.rank_1_hook is not None:
        callbacks.append(PatchRank(1, args.rank_1_hook))
    strategy = CPUDeepSpeedStrategy(config=str(args.config))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                        max_epochs=ROUNDS * module.hparams.policy_epochs_per_round, limit_train_batches=1,
                        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, datamodule=_data())


def zero3_config(tmp_path: Path) -> Path:
    """The shipped zero3.json with every parameter sharded (test_strategies.zero_config), as in a real LLM,
    and no parameter-reuse window: on tiny models its default 1e9 elements span the whole module trace,
    which DeepSpeed scans on every release (four times slower here)."""
    path = zero_config(tmp_path, stage=3)
    config = json.loads(path.read_text())
    config["zero_optimization"]["stage3_max_reuse_distance"] = 0
    path.write_text(json.dumps(config))
    return path


def run_ranks(tmp_path: Path, devices: int, *extra: str, timeout: float) -> list[dict]:
    """Runs this file as a script on ``devices`` ranks; each rank's Probe record. A run still going after
    ``timeout`` seconds (ranks waiting on each other's collectives) is killed with all its ranks."""
    out = tmp_path / "run"
    command = [sys.executable, __file__, "--config", str(zero3_config(tmp_path)), "--devices", str(devices),
               "--out", str(out), *extra]
    # Its own process group: Lightning starts the other ranks as children, and a hung run must not outlive the test.
    with subprocess.Popen(command, env=rlfr_run.env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"the {devices}-rank run did not finish in {timeout:.0f} s\n{stdout[-3000:]}{stderr[-3000:]}")
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return [torch.load(rank_output(out, rank), weights_only=True) for rank in range(devices)]


def plain_module(weights: dict[str, torch.Tensor]) -> L.LightningModule:
    """The module without DeepSpeed, holding ``weights``."""
    module = _policy()
    # setup() builds the flow (its output width comes from the data); no epoch runs.
    L.Trainer(accelerator="cpu", max_epochs=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(module, datamodule=_data())
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(weights[name])
    return module


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], group: str) -> bool:
    prefix = {"lora": "policy.", "flow": "reward_model."}[group]
    return any(not torch.equal(before[n], after[n]) for n in before if n.startswith(prefix))


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_policy_trains_under_zero3_with_the_plain_modules_flow_reward(tmp_path, devices):
    run = run_ranks(tmp_path, devices, timeout=300)[0]
    assert run["world_size"] == devices

    for key in ("round/flow_loss", "train/policy_loss", "train/reward_mean", "train/approx_kl"):
        assert math.isfinite(run["metrics"][key]), key
    phases = run["phases"]
    for epoch in range(ROUNDS):
        start, flow_trained, end = (phases[f"{epoch}/{p}"] for p in ("start", "flow_trained", "end"))
        # As with plain Adam, each phase moves only its own parameter group.
        assert changed(start, flow_trained, "flow") and not changed(start, flow_trained, "lora"), epoch
        assert changed(flow_trained, end, "lora") and not changed(flow_trained, end, "flow"), epoch

    plain = plain_module(run["weights"])
    expected = flow_reward(plain, plain.trainer.datamodule.test_records[:PROBE_ROWS])
    for field in ("probs", "rewards", "true_logit_mean"):
        torch.testing.assert_close(run["reward"][field], getattr(expected, field), msg=lambda m, f=field: f"{f}: {m}")


@pytest.mark.slow
def test_ranks_that_accept_different_numbers_of_explanations_train_the_flow_in_step(tmp_path):
    runs = run_ranks(tmp_path, 2, "--rank-1-hook", "reject-all", timeout=120)
    assert runs[0]["metrics"]["round/acceptance"] > 0 and runs[1]["metrics"]["round/acceptance"] == 0
    assert math.isfinite(runs[0]["metrics"]["round/flow_loss"])
    phases = runs[0]["phases"]
    for epoch in range(ROUNDS):  # rank 0's accepted pairs still train the flow, every round
        assert changed(phases[f"{epoch}/start"], phases[f"{epoch}/flow_trained"], "flow"), epoch
    for name, weight in runs[0]["weights"].items():
        torch.testing.assert_close(runs[1]["weights"][name], weight, rtol=0, atol=0, msg=name)
    # Held-out accuracies are computed over both ranks' rows (rank 1 has no positives of its own).
    accuracies = [{k: v for k, v in run["metrics"].items() if k.startswith("round/flow_accuracy_")} for run in runs]
    assert "round/flow_accuracy_positive" in accuracies[0] and accuracies[0] == accuracies[1]


@pytest.mark.slow
def test_ranks_with_different_sentence_counts_take_the_proxy_reward_in_step(tmp_path):
    runs = run_ranks(tmp_path, 2, "--reward", "proxy", "--rank-1-hook", "sentence-per-token", timeout=120)
    for run in runs:
        assert math.isfinite(run["metrics"]["train/reward_mean"])
    phases = runs[0]["phases"]
    for epoch in range(ROUNDS):
        assert changed(phases[f"{epoch}/flow_trained"], phases[f"{epoch}/end"], "lora"), epoch
        assert not changed(phases[f"{epoch}/start"], phases[f"{epoch}/end"], "flow"), epoch


if __name__ == "__main__":
    main()
