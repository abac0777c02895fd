"""RL step time on the tiny policy with and without the flow reward, measured in one run.

    python benchmarks/bench_rl_step.py [--steps 12] [--warmup 2] [--rounds 2]

Both variants run the same PolicyModule on the same prompts (bundled tiny_adder, 16 prompts × 8 samples, as configs/rlfr_tiny.yaml);
the flow variant adds the latent tap, the flow reward of rlfr_tiny.yaml (one tapped block, P = 0.25, T = {0.9})
and the online flow update (κ = 32). Both forward every row (``update.skip_zero_advantage_rows: false``): the skip applies
to plain GRPO only, so it would count as flow overhead; bench_trl_race.py measures it. The variants alternate ``--rounds`` times (grpo, grpo+flow, grpo, ...), so a busy machine slows
both alike. Prints median / p20 / p80 step time per variant over all rounds and the ratio of medians, and appends
rows to benchmarks/results/results.csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch

from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.modules.policy_options import OptimOptions, SamplingOptions, UpdateOptions
from flowkit.rewards import FlowReward
from flowkit.rewards.flow import LatentOptions, NetworkOptions, ScoringOptions

BENCHMARKS = str(Path(__file__).resolve().parent)


class StepTimer(L.Callback):
    """Seconds (on ``clock``, a name of :data:`CLOCKS`), mean response length (tokens) and mean outcome reward of every
    RL step."""

    def __init__(self, clock: str = "wall"):
        from common import CLOCKS

        self.clock = CLOCKS[clock]
        self.times: list[float] = []
        self.lengths: list[float] = []
        self.rewards: list[float] = []

    def on_train_batch_start(self, *args):
        self._start = self.clock()

    def on_train_batch_end(self, trainer, *args):
        self.times.append(self.clock() - self._start)
        self.lengths.append(float(trainer.callback_metrics.get("train/response_length", float("nan"))))
        self.rewards.append(float(trainer.callback_metrics.get("train/outcome_reward", float("nan"))))


def time_steps(reward_model, steps: int, warmup: int, prompts: int = 16, clock: str = "wall", seed: int = 0,
               **options) -> StepTimer:
    """Seconds (on ``clock``) and response lengths of each of ``steps`` RL steps after ``warmup`` of the tiny job
    (``options`` override its PolicyModule settings), and the outcome reward of every step, warm-up included."""
    L.seed_everything(seed)
    settings = {"sampling": SamplingOptions(num_samples=8, max_new_tokens=28), "outcome_reward": "binary",
                "optim": OptimOptions(lr=5e-5, flow_lr=1e-3), **options}
    module = PolicyModule(reward_model=reward_model, **settings)
    data = RolloutDataModule(val_path=None, batch_size=prompts)
    timer = StepTimer(clock)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps + warmup, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
                        limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    timer.times, timer.lengths = timer.times[warmup:], timer.lengths[warmup:]
    return timer


def quantiles(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"median_ms": 1e3 * statistics.median(times), "p20_ms": 1e3 * pick(0.2), "p80_ms": 1e3 * pick(0.8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two variants")
    parser.add_argument("--csv", default=None, help="CSV to append to (default benchmarks/results/results.csv)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"grpo": [], "grpo+flow": []}
    for _ in range(args.rounds):
        every_row = UpdateOptions(skip_zero_advantage_rows=False)
        times["grpo"] += time_steps(None, args.steps, args.warmup, update=every_row).times
        flow = FlowReward(latents=LatentOptions(percentiles=(0.25,)), network=NetworkOptions(depth=2),
                          scoring=ScoringOptions(timesteps=(0.9,)))
        times["grpo+flow"] += time_steps(flow, args.steps, args.warmup, update=every_row).times
    results = {name: quantiles(t) for name, t in times.items()}
    sys.path.insert(0, BENCHMARKS)
    from common import append_csv, timestamp
    for name, stats in results.items():
        print(f"{name:10s} median {stats['median_ms']:8.1f} ms  p20 {stats['p20_ms']:8.1f}  p80 {stats['p80_ms']:8.1f}")
        append_csv(args.csv, {"timestamp": timestamp(), "benchmark": "rl_step", "implementation": name, "device": "cpu",
                          "size": "tiny_adder 16x8", "threads": torch.get_num_threads(), **stats})
    ratio = results["grpo+flow"]["median_ms"] / results["grpo"]["median_ms"]
    print(f"step time ratio (with flow / without): {ratio:.2f}")


if __name__ == "__main__":
    main()
