"""The README's main job against an earlier revision: wall time of ``flowkit fit --config configs/rlfr_tiny.yaml``.

    python benchmarks/bench_main_job.py --baseline 7f65e5f [--rounds 3]
    python benchmarks/bench_main_job.py --baseline 124fa5d --equal-metrics [--steps 8 --pretrain-steps 50]

This checkout's working tree and ``--baseline`` (any git revision, each side with its own ``rlfr_tiny.yaml``) run
the job in alternation, back to back, as the README runs it (torch's default threads): run it on an otherwise idle
machine. The baseline runs from a ``git archive`` copy; it reuses this checkout's built native ops when ``csrc/``
and ``setup.py`` are the same at both, and builds them in the copy otherwise. Reports every run's wall time and its
learning (mean outcome reward of the last 10 steps minus the first 10: issue 10's ≥ 0.05), the median ratio
current / baseline (issue 10: ≤ 1), and appends one row per run to the results CSV.

``--equal-metrics`` instead runs a shortened job once per side on one thread (``--steps`` RL steps, validation at the
end, ``--pretrain-steps`` of flow pretraining, set in each side's own key) and compares the two ``metrics.csv`` column
by column and the exported weights (issue 31: the main job's fixed-seed metrics are equal before and after). Left
out: wall-clock columns (``time/*``, ``perf/*``, ``train/tokens_per_s``) and any column only one side logs (named).
Exits 1 when anything else differs.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import append_csv, timestamp

REPO = Path(__file__).resolve().parent.parent
WALL_CLOCK = ("time/", "perf/", "train/tokens_per_s")  # measurements of this machine's speed, not of the learning


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


def run_job(tree: Path, run_dir: Path, log: Path, options: list[str] | None = None,
            env: dict[str, str] | None = None) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    start = time.perf_counter()
    with log.open("w") as out:
        subprocess.run([sys.executable, "-m", "flowkit", "fit", "--config", "configs/rlfr_tiny.yaml",
                        "--trainer.default_root_dir", str(run_dir), *(options or [])], cwd=tree, env=env, stdout=out,
                       stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - start


def short_job(tree: Path, steps: int, pretrain_steps: int) -> list[str]:
    """The options of the shortened job, pretraining steps in ``tree``'s own key (flat before the option groups)."""
    flat = "flow_pretrain_steps:" in (tree / "configs" / "rlfr_tiny.yaml").read_text(encoding="utf-8")
    key = "flow_pretrain_steps" if flat else "flow_pretrain.steps"
    return ["--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
            f"--model.init_args.{key}", str(pretrain_steps)]


def compare_runs(runs: dict[str, Path]) -> bool:
    """Prints which metrics.csv columns and exported weights of the two runs are equal; True when all are."""
    tables = {side: list(csv.DictReader(next(run.rglob("metrics.csv")).open())) for side, run in runs.items()}
    baseline, current = tables.values()
    columns = {side: set(rows[0]) for side, rows in tables.items()}
    for side, other in (("baseline", "current"), ("current", "baseline")):
        print(f"only {side} logs: {sorted(columns[side] - columns[other]) or 'none'}")
    shared = sorted(columns["baseline"] & columns["current"])
    print(f"left out (wall clock): {[c for c in shared if c.startswith(WALL_CLOCK)]}")
    equal, differ = [], {}
    for column in (c for c in shared if not c.startswith(WALL_CLOCK)):
        pairs = [(a[column], b[column]) for a, b in zip(baseline, current)]
        if len(baseline) == len(current) and all(a == b for a, b in pairs):
            equal.append(column)
        else:
            differ[column] = max((abs(float(a) - float(b)) for a, b in pairs if a and b and a != b), default=0.0)
    print(f"{len(equal)} columns equal in all {len(current)} rows: {equal}")
    for column, gap in differ.items():
        print(f"DIFFERS {column}: max |baseline - current| {gap:.3g} (rows {len(baseline)} vs {len(current)})")
    weights = {side: {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
                      for p in run.rglob("export/**/*.safetensors")} for side, run in runs.items()}
    print(f"exported weights equal: {weights['baseline'] == weights['current']} ({sorted(weights['current'])})")
    return not differ and weights["baseline"] == weights["current"] and bool(weights["current"])


def equal_metrics(args: argparse.Namespace) -> bool:
    """Runs the shortened job on both sides and compares them (:func:`compare_runs`)."""
    with tempfile.TemporaryDirectory(prefix="bench_main_job_") as tmp:
        trees = {"baseline": baseline_tree(args.baseline, Path(tmp) / "baseline"), "current": REPO}
        runs = {side: Path(tmp) / f"{side}_run" for side in trees}
        for side, tree in trees.items():
            options = short_job(tree, args.steps, args.pretrain_steps)
            wall = run_job(tree, runs[side], Path(tmp) / f"{side}.log", options,
                           env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
            print(f"{side}: {wall:.0f} s", flush=True)
        same = compare_runs(runs)
    print(f"metrics of current and baseline@{args.baseline}: {'equal' if same else 'DIFFERENT'}")
    return same


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
    parser.add_argument("--equal-metrics", action="store_true", help="compare a short job's metrics, not wall time")
    parser.add_argument("--steps", type=int, default=8, help="RL steps of --equal-metrics's job")
    parser.add_argument("--pretrain-steps", type=int, default=50, help="flow pretraining steps of that job")
    args = parser.parse_args()
    if args.equal_metrics:
        sys.exit(0 if equal_metrics(args) else 1)
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
