"""How long `flowkit --help` and `flowkit fit --help` take, in a subprocess as a user runs them.

Two measurements per command, ``cold`` (an empty help cache) and ``warm`` (a second call), and for reference the
bare ``import torch`` and ``import lightning.pytorch``. ``flowkit --help`` imports neither torch nor Lightning, cold
or warm; ``flowkit fit --help`` builds its text with Lightning's parser on a cold call (the imports are its floor)
and serves it from the cache after that. Rows go to benchmarks/results/results.csv::

    python benchmarks/bench_cli_startup.py --reps 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import append_csv, timestamp

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {"flowkit --help": ["--help"], "flowkit fit --help": ["fit", "--help"]}


def seconds(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="calls per measurement (median reported)")
    parser.add_argument("--csv", default=None, help="results CSV (default benchmarks/results/results.csv)")
    options = parser.parse_args()
    flowkit = shutil.which("flowkit") or "flowkit"
    base = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    load = os.getloadavg()[0]
    results = {f"import {module}": ("reference", [seconds([sys.executable, "-c", f"import {module}"], base)
                                                  for _ in range(options.reps)])
               for module in ("torch", "lightning.pytorch")}  # the floors of any text built by Lightning's parser
    for name, args in COMMANDS.items():
        cold, warm = [], []
        for _ in range(options.reps):
            with tempfile.TemporaryDirectory() as cache:
                env = {**base, "FLOWKIT_CACHE_DIR": cache}
                cold.append(seconds([flowkit, *args], env))
                warm.append(seconds([flowkit, *args], env))
        results[name] = ("cold", cold)
        results[f"{name} "] = ("warm", warm)
    for name, (kind, times) in results.items():
        median = statistics.median(times)
        deciles = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
        print(f"{name.strip():28s} {kind:9s} median {median:6.2f} s  (min {min(times):.2f}, max {max(times):.2f}, "
              f"{len(times)} calls, load average {load:.1f})")
        append_csv(options.csv, {"benchmark": "cli_startup", "implementation": kind, "size": name.strip(),
                                 "median_ms": median * 1e3, "p20_ms": deciles[1] * 1e3, "p80_ms": deciles[7] * 1e3,
                                 "device": "cpu", "timestamp": timestamp()})


if __name__ == "__main__":
    main()
