"""ExplanationPolicyModule under DeepSpeed ZeRO-3 on CPU (``deepspeed_cpu_stage_3``), the paper's setting.

Under ZeRO-3 every rank holds only shards of the parameters outside their modules' forwards, yet the flow
reads the frozen last layer's W_Q/W_K/W_V as tensors. The run is a subprocess — this file as a script —
as in tests/test_strategies.py: Lightning relaunches the script per rank, and a DeepSpeed process group
lives as long as its process. The test then recomputes, in this plain process, the flow reward from the
run's final weights and compares it with the one computed under ZeRO-3.
"""

from __future__ import annotations

import argparse
import json
import math
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


class Probe(L.Callback):
    """Rank 0 saves the trainable weights at every phase boundary, the final weights, the logged metrics and
    the flow reward of the probe rows computed under ZeRO-3 (outside any forward, like a round's flow phase)."""

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
        if trainer.global_rank == 0:
            metrics = {key: float(value) for key, value in trainer.logged_metrics.items()}
            torch.save({"reward": vars(reward), "weights": weights, "phases": self.phases, "metrics": metrics,
                        "world_size": trainer.world_size}, self.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True, help="DeepSpeed config")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    module = _policy()
    strategy = CPUDeepSpeedStrategy(config=str(args.config))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                        max_epochs=ROUNDS * module.hparams.policy_epochs_per_round, limit_train_batches=1,
                        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Probe(args.out)])
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
    out = tmp_path / "run.pt"
    result = subprocess.run([sys.executable, __file__, "--config", str(zero3_config(tmp_path)), "--devices",
                             str(devices), "--out", str(out)],
                            env=rlfr_run.env(), cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = torch.load(out, weights_only=True)
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


if __name__ == "__main__":
    main()
