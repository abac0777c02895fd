"""The README's main job against an earlier revision: wall time of ``flowkit fit --config configs/rlfr_tiny.yaml``.

    python benchmarks/bench_main_job.py --baseline 7f65e5f [--rounds 3]

This checkout's working tree and ``--baseline`` (any git revision, each side with its own ``rlfr_tiny.yaml``) run
the job in alternation, back to back, as the README runs it (torch's default threads): run it on an otherwise idle
machine. The baseline runs from a ``git archive`` copy; it reuses this checkout's built native ops when ``csrc/``
and ``setup.py`` are the same at both, and builds them in the copy otherwise. Reports every run's wall time and its
learning (mean outcome reward of the last 10 steps minus the first 10: issue 10's ≥ 0.05), the median ratio
current / baseline (issue 10: ≤ 1), and appends one row per run to the results CSV.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import append_csv, timestamp

REPO = Path(__file__).resolve().parent.parent


def baseline_tree(revision: str, into: Path) -> Path:
    """``revision``'s files in ``into``, with native ops that match its ``csrc/``."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    native_diff = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", revision, "--", "csrc", "setup.py"])
    same_native = native_diff.returncode == 0
    built = list((REPO / "flowkit").glob("_C*.so"))
    if same_native and built:
        for library in built:
            (into / "flowkit" / library.name).write_bytes(library.read_bytes())
    else:
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=into, check=True,
                       stdout=subprocess.DEVNULL)
    return into


def run_job(tree: Path, run_dir: Path, log: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with log.open("w") as out:
        subprocess.run([sys.executable, "-m", "flowkit", "fit", "--config", "configs/rlfr_tiny.yaml",
                        "--trainer.default_root_dir", str(run_dir)], cwd=tree, env=env, stdout=out,
                       stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - start


def learning(tree: Path, run_dir: Path, since: float) -> float:
    """Last-10 minus first-10 mean outcome reward of the run's metrics (older configs log under ``tree/runs``)."""
    logs = [p for root in (run_dir, tree / "runs") for p in root.rglob("metrics.csv") if p.stat().st_mtime >= since]
    rows = [r for r in csv.DictReader(max(logs, key=lambda p: p.stat().st_mtime).open()) if r.get("train/outcome_reward")]
    rewards = [float(r["train/outcome_reward"]) for r in rows]
    return statistics.fmean(rewards[-10:]) - statistics.fmean(rewards[:10])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision to compare with, e.g. 7f65e5f")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    walls: dict[str, list[float]] = {"baseline": [], "current": []}
    with tempfile.TemporaryDirectory(prefix="bench_main_job_") as tmp:
        trees = {"baseline": baseline_tree(args.baseline, Path(tmp) / "baseline"), "current": REPO}
        for round_ in range(1, args.rounds + 1):
            for side, tree in trees.items():
                run_dir, since = Path(tmp) / f"{side}_{round_}", time.time()
                wall = run_job(tree, run_dir, Path(tmp) / f"{side}_{round_}.log")
                gain = learning(tree, run_dir, since)
                walls[side].append(wall)
                label = f"baseline@{args.baseline}" if side == "baseline" else "current"
                print(f"round {round_} {label:>18}: {wall:6.1f} s, outcome reward last 10 − first 10 {gain:+.3f}",
                      flush=True)
                append_csv(args.csv, {"timestamp": timestamp(), "benchmark": "main_job", "implementation": label,
                                      "device": "cpu", "size": "configs/rlfr_tiny.yaml", "median_ms": 1e3 * wall,
                                      "learning": gain})
    ratio = statistics.median(walls["current"]) / statistics.median(walls["baseline"])
    print(f"median wall time current / baseline@{args.baseline}: {ratio:.2f} (target <= 1)")


if __name__ == "__main__":
    main()
