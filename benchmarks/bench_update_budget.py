"""The update phase at several micro-batch budgets, on the same experiences, interleaved in one process.

    python benchmarks/bench_update_budget.py [--budgets 0,1024,2048] [--steps 3] [--rounds 6] [--csv F]

Runs ``--steps`` steps of the tiny job (the TRL race's: bundled tiny_adder, 16 prompts × 8 samples, 28 new tokens,
the binary reward, one thread; rows longest first, as a budget orders them), keeps each step's
:class:`~flowkit.step.Experience`, then trains on those experiences
again, ``--rounds`` times over: in each round every budget (``update.micro_batch_tokens``; 0: one micro-batch of all
rows, flowkit's default) trains on every kept experience in turn. Each update moves the policy a little, as a real
step does; the rows and their lengths stay the kept ones, so every budget times the same work and the machine's drift
over minutes hits all of them alike (separate processes minutes apart could not resolve a 10% effect here). Reports
each budget's median update time and its median ratio to the first budget's, paired update by update.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

from flowkit.modules.policy_options import OptimOptions, SamplingOptions, UpdateOptions
from flowkit.step.train_on import PolicyUpdate

BENCHMARKS = str(Path(__file__).resolve().parent)


def kept_experiences(steps: int, budget: int) -> tuple[PolicyUpdate, list, object]:
    """The tiny job's update phase, the experiences of its ``steps`` steps and its optimizer, the job run at
    ``micro_batch_tokens`` ``budget`` (0: none; any budget orders a step's rows longest first, as every budget
    needs them, and one micro-batch holds them in any order)."""
    sys.path.insert(0, BENCHMARKS)
    from bench_rl_step import time_steps

    kept = []
    train_on = PolicyUpdate.train_on

    def keep(self, experience, optimizer, *args, **kwargs):
        kept.append((self, experience, optimizer))
        return train_on(self, experience, optimizer, *args, **kwargs)

    PolicyUpdate.train_on = keep
    try:
        time_steps(None, steps, 0, sampling=SamplingOptions(num_samples=8, max_new_tokens=28),
                   optim=OptimOptions(lr=5e-5, flow_lr=1e-3), update=UpdateOptions(micro_batch_tokens=budget or None))
    finally:
        PolicyUpdate.train_on = train_on
    return kept[0][0], [experience for _, experience, _ in kept], kept[0][2]


def interleaved_update_times(budgets: list[int], steps: int, rounds: int) -> dict[int, list[float]]:
    """Wall seconds of each update, per budget, the budgets taking turns on each kept experience."""
    torch.set_num_threads(1)
    update, experiences, optimizer = kept_experiences(steps, max(budgets))
    times: dict[int, list[float]] = {budget: [] for budget in budgets}
    for _ in range(rounds):
        for experience in experiences:
            for budget in budgets:
                update.update = dataclasses.replace(update.update, micro_batch_tokens=budget or None)
                start = time.perf_counter()
                update.train_on(experience, optimizer)
                times[budget].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0,1024,2048",
                        help="update.micro_batch_tokens values, comma-separated (0: one micro-batch); the first is "
                             "the one the others are compared with")
    parser.add_argument("--steps", type=int, default=3, help="steps whose experiences are kept")
    parser.add_argument("--rounds", type=int, default=6, help="passes over the kept experiences, every budget each")
    parser.add_argument("--csv", default=None, help="CSV to append to (default benchmarks/results/results.csv)")
    args = parser.parse_args()
    budgets = [int(budget) for budget in args.budgets.split(",")]
    if len(set(budgets)) != len(budgets) or min(budgets) < 0:
        parser.error("--budgets must be distinct values >= 0")
    times = interleaved_update_times(budgets, args.steps, args.rounds)
    sys.path.insert(0, BENCHMARKS)
    from common import append_csv, timestamp
    first = budgets[0]
    for budget, seconds in times.items():
        ratio = statistics.median(a / b for a, b in zip(seconds, times[first]))
        print(f"micro_batch_tokens {budget or 'none':>5}: update median {1e3 * statistics.median(seconds):.1f} ms, "
              f"paired ratio to {first or 'none'}: {ratio:.3f} ({len(seconds)} updates)")
        append_csv(args.csv, {"timestamp": timestamp(), "benchmark": "update_budget", "device": "cpu",
                              "implementation": f"micro_batch_tokens {budget or 'none'}", "threads": 1,
                              "size": "tiny_adder 16x8", "median_ms": 1e3 * statistics.median(seconds),
                              "ratio": ratio})


if __name__ == "__main__":
    main()
