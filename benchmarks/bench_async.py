"""Step time of generation apart from training on the tiny task: a ``flowkit rollout-server`` on one core, the
trainer on the other, synchronous (``rollout.max_staleness: 0``) against one step off (``rollout.max_staleness: 1``), and today's
colocated HF engine (generation and training in turn on the trainer's core), measured in one run.

    python benchmarks/bench_async.py [--steps 10] [--warmup 2] [--rounds 2]

The job is configs/rlfr_tiny.yaml's RL step (bundled tiny_adder, 16 prompts × 8 samples, 28 new tokens, the flow
reward with its online update), no offline pretraining. The server is pinned to core 0 (``taskset``), this process
to core 1, one intra-op thread each. The variants alternate ``--rounds`` times so that a busy machine slows all
alike. Prints median / p20 / p80 step time per variant, the median time a step waits for its rollouts
(``time/generate_s``: the whole generation when it is in turn with training, the part not hidden behind the previous
step when it overlaps) and the ratios of medians, and appends rows to benchmarks/results/results.csv.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch

from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.modules.policy_options import OptimOptions, RolloutOptions, SamplingOptions
from flowkit.rewards import FlowReward

BENCHMARKS = Path(__file__).resolve().parent
STARTUP_S = 180


def start_server(log: Path, core: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [shutil.which("flowkit") or "flowkit", "rollout-server", "--backbone", "bundled:tiny_adder", "--port",
               str(port)]
    if shutil.which("taskset"):
        command = ["taskset", "-c", str(core), *command]
    process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log.open("w"),
                               stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_S
    while "rollout server for" not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the rollout server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    return process, f"http://127.0.0.1:{port}"


def time_steps(steps: int, warmup: int, **options) -> tuple[list[float], list[float]]:
    """Seconds of each step after ``warmup``, and of each step's wait for its rollouts (``time/generate_s``)."""
    sys.path.insert(0, str(BENCHMARKS))
    from bench_rl_step import StepTimer

    class Timer(StepTimer):
        waits: list[float] = []

        def on_train_batch_end(self, trainer, *args):
            super().on_train_batch_end(trainer, *args)
            self.waits.append(float(trainer.callback_metrics["time/generate_s"]))

    L.seed_everything(0)
    flow = FlowReward(percentiles=[0.25], depth=2, timesteps=[0.9], eta=0.6, beta=0.01, normalization="minmax",
                      condition="previous", rejection_metric="correct", kappa=32)
    module = PolicyModule(reward_model=flow, outcome_reward="binary", **options,
                          sampling=SamplingOptions(num_samples=8, max_new_tokens=28),
                          optim=OptimOptions(lr=5e-5, flow_lr=1e-3))
    timer = Timer()
    timer.waits = []
    trainer = L.Trainer(accelerator="cpu", max_steps=steps + warmup, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
                        limit_val_batches=0)
    trainer.fit(module, datamodule=RolloutDataModule(val_path=None, batch_size=16))
    return timer.times[warmup:], timer.waits[warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the three variants")
    parser.add_argument("--csv", default=None, help="CSV to append to (default benchmarks/results/results.csv)")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: one for the server, one for the trainer")
    process, url = start_server(Path(os.environ.get("TMPDIR", "/tmp")) / "bench_async_server.log", cores[0])
    os.sched_setaffinity(0, {cores[1]})
    torch.set_num_threads(1)
    server = RolloutOptions(engine="server", server_url=url, server_timeout=120.0)
    variants = {"colocated hf": {}, "server sync": {"rollout": server},
                "server async k=1": {"rollout": replace(server, max_staleness=1)}}
    times: dict[str, list[float]] = {name: [] for name in variants}
    waits: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(args.rounds):
            for name, options in variants.items():
                step_times, wait_times = time_steps(args.steps, args.warmup, **options)
                times[name] += step_times
                waits[name] += wait_times
    finally:
        process.kill()
        process.wait(timeout=30)
    sys.path.insert(0, str(BENCHMARKS))
    from bench_rl_step import quantiles
    from common import append_csv, timestamp

    results = {name: quantiles(t) for name, t in times.items()}
    for name, stats in results.items():
        wait = 1e3 * statistics.median(waits[name])
        print(f"{name:18s} median {stats['median_ms']:8.1f} ms  p20 {stats['p20_ms']:8.1f}  p80 {stats['p80_ms']:8.1f}"
              f"  (waiting for rollouts: median {wait:7.1f} ms)")
        append_csv(args.csv, {"timestamp": timestamp(), "benchmark": "async", "implementation": name, "device": "cpu",
                              "size": "tiny_adder 16x8, server core 0, trainer core 1", "threads": 1, **stats})
    async_ms = results["server async k=1"]["median_ms"]
    print(f"step time, async k=1 / server sync: {async_ms / results['server sync']['median_ms']:.2f}")
    print(f"step time, async k=1 / colocated hf: {async_ms / results['colocated hf']['median_ms']:.2f}")


if __name__ == "__main__":
    main()
