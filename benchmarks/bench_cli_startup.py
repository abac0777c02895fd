"""How long `flowkit --help`, `flowkit COMMAND --help` and a misspelt trainer option take, in a fresh subprocess
each time, as a user runs them.

None imports torch or Lightning: a command's help, and the options an unknown ``--trainer.NAME`` is checked against,
are built from the sources (``flowkit.command_help``). For reference, in the same run: the bare ``import torch`` and
``import lightning.pytorch``, the same ``fit --help`` text from Lightning's parser (what ``flowkit fit --help`` ran
before) and the same mistake found by that parser (what ``flowkit`` ran before), with the ratios. Exits 1 when a
flowkit call takes longer than ``--bound`` (2 s). Rows go to benchmarks/results/results.csv::

    python benchmarks/bench_cli_startup.py --reps 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import append_csv, timestamp

ROOT = Path(__file__).resolve().parent.parent
MISTAKE = ["fit", "--config", "configs/rlfr_tiny.yaml", "--trainer.max_step", "3"]  # exits 2: "did you mean"
COMMANDS = {"flowkit --help": ["--help"], "flowkit fit --help": ["fit", "--help"],
            "flowkit export --help": ["export", "--help"], "flowkit fit --trainer.max_step 3": MISTAKE}
PARSER_HELP = ("from flowkit.lightning_cli import run\n"
               "try:\n    run(['fit', '--help'], '')\nexcept SystemExit:\n    pass")
PARSER_MISTAKE = ("from flowkit.errors import ConfigError\nfrom flowkit.lightning_cli import run\n"
                  f"try:\n    run({MISTAKE!r}, '')\nexcept ConfigError:\n    pass")


def seconds(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          check=False)
    if done.returncode not in (0, 2) or (done.returncode == 2 and "did you mean" not in done.stderr):
        raise RuntimeError(f"{command} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="calls per measurement (median reported)")
    parser.add_argument("--csv", default=None, help="results CSV (default benchmarks/results/results.csv)")
    parser.add_argument("--bound", type=float, default=2.0,
                        help="seconds no flowkit help may take (the slowest call); exit 1 above it")
    options = parser.parse_args()
    flowkit = shutil.which("flowkit") or "flowkit"
    base = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    load = os.getloadavg()[0]
    python = [sys.executable, "-c"]
    results = {f"import {module}": ("reference", [seconds([*python, f"import {module}"], base)
                                                  for _ in range(options.reps)])
               for module in ("torch", "lightning.pytorch")}  # the floors of any text built by Lightning's parser
    results["fit --help by Lightning's parser"] = ("reference", [seconds([*python, PARSER_HELP], base)
                                                                 for _ in range(options.reps)])
    results["fit --trainer.max_step by the parser"] = ("reference", [seconds([*python, PARSER_MISTAKE], base)
                                                                     for _ in range(options.reps)])
    for name, args in COMMANDS.items():
        results[name] = ("flowkit", [seconds([flowkit, *args], base) for _ in range(options.reps)])
    for name, (kind, times) in results.items():
        median = statistics.median(times)
        deciles = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
        print(f"{name:38s} {kind:9s} median {median:6.2f} s  (min {min(times):.2f}, max {max(times):.2f}, "
              f"{len(times)} calls, load average {load:.1f})")
        append_csv(options.csv, {"benchmark": "cli_startup", "implementation": kind, "size": name,
                                 "median_ms": median * 1e3, "p20_ms": deciles[1] * 1e3, "p80_ms": deciles[7] * 1e3,
                                 "device": "cpu", "timestamp": timestamp()})
    for ours, theirs in (("flowkit fit --help", "fit --help by Lightning's parser"),
                         ("flowkit fit --trainer.max_step 3", "fit --trainer.max_step by the parser")):
        ratio = statistics.median(results[ours][1]) / statistics.median(results[theirs][1])
        print(f"{ours} / {theirs}: {ratio:.3f}x")
    slowest = max(max(times) for kind, times in results.values() if kind == "flowkit")
    print(f"slowest flowkit call {slowest:.2f} s: {'within' if slowest <= options.bound else 'ABOVE'} the "
          f"{options.bound:.1f} s bound")
    if slowest > options.bound:
        sys.exit(1)


if __name__ == "__main__":
    main()
