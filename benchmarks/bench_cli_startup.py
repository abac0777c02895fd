"""How long `flowkit --help` and `flowkit COMMAND --help` take, in a fresh subprocess each time, as a user runs them.

Neither imports torch nor Lightning: a command's help is built from the sources (``flowkit.command_help``). For
reference, in the same run: the bare ``import torch`` and ``import lightning.pytorch``, and the same ``fit --help``
text from Lightning's parser (what ``flowkit fit --help`` ran before), with the ratio of the two. Exits 1 when a
flowkit help call takes longer than ``--bound`` (2 s). Rows go to benchmarks/results/results.csv::

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
COMMANDS = {"flowkit --help": ["--help"], "flowkit fit --help": ["fit", "--help"],
            "flowkit export --help": ["export", "--help"]}
PARSER_HELP = ("from flowkit.lightning_cli import run\n"
               "try:\n    run(['fit', '--help'], '')\nexcept SystemExit:\n    pass")


def seconds(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
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
    for name, args in COMMANDS.items():
        results[name] = ("flowkit", [seconds([flowkit, *args], base) for _ in range(options.reps)])
    for name, (kind, times) in results.items():
        median = statistics.median(times)
        deciles = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
        print(f"{name:34s} {kind:9s} median {median:6.2f} s  (min {min(times):.2f}, max {max(times):.2f}, "
              f"{len(times)} calls, load average {load:.1f})")
        append_csv(options.csv, {"benchmark": "cli_startup", "implementation": kind, "size": name,
                                 "median_ms": median * 1e3, "p20_ms": deciles[1] * 1e3, "p80_ms": deciles[7] * 1e3,
                                 "device": "cpu", "timestamp": timestamp()})
    ratio = statistics.median(results["flowkit fit --help"][1]) / statistics.median(
        results["fit --help by Lightning's parser"][1])
    print(f"flowkit fit --help / the parser's: {ratio:.3f}x")
    slowest = max(max(times) for kind, times in results.values() if kind == "flowkit")
    print(f"slowest flowkit help call {slowest:.2f} s: {'within' if slowest <= options.bound else 'ABOVE'} the "
          f"{options.bound:.1f} s bound")
    if slowest > options.bound:
        sys.exit(1)


if __name__ == "__main__":
    main()
