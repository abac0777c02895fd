"""RBRL results table: trained selector vs uniform-random rule choice vs each fixed rule.

Runs ``flowkit fit --config C --seed_everything S`` for every config C and training seed S (each fit
prints its own table over the DataModule's evaluation seeds and writes ``results.json``), then prints
one table per environment: the trained selector as mean ± std over training seeds (each value the mean
over evaluation seeds), the baselines (which do not depend on the training seed) as mean ± std over
evaluation seeds, and whether the trained selector beat random choice for every training seed.

    python scripts/rbrl_results.py                       # both environments, training seeds 0 1 2
    python scripts/rbrl_results.py --configs configs/rbrl_wearables.yaml --seeds 0 1 2 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from flowkit.cli import main as flowkit_main

DEFAULT_CONFIGS = ["configs/rbrl_binpacking.yaml", "configs/rbrl_wearables.yaml"]


def run(config: str, seed: int, root: Path) -> dict:
    run_dir = root / Path(config).stem / f"seed{seed}"
    start = time.monotonic()
    flowkit_main(["fit", "--config", config, "--seed_everything", str(seed), "--trainer.default_root_dir", str(run_dir)])
    seconds = time.monotonic() - start
    newest = max(run_dir.glob("lightning_logs/version_*/results.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(newest.read_text()) | {"fit_seconds": seconds}


def table(name: str, runs: dict[int, dict]) -> str:
    seeds = sorted(runs)
    trained = np.array([np.mean(runs[s]["trained selector"]) for s in seeds])
    first = runs[seeds[0]]
    baselines = {k: np.array(v) for k, v in first.items() if k not in ("trained selector", "eval_seeds", "fit_seconds")}
    random_mean = baselines["random rule"].mean()
    rows = [(f"trained selector ({len(seeds)} training seeds)", trained.mean(), trained.std(ddof=1), trained)]
    rows += [(f"{k} ({len(v)} eval seeds)", v.mean(), v.std(ddof=1), v) for k, v in baselines.items()]
    lines = [
        f"== {name}: mean episode return ± std; evaluation seeds {first['eval_seeds']}",
        f"{'policy':48s} {'mean':>9s} {'± std':>7s}   values",
    ]
    for label, mean, std, values in sorted(rows, key=lambda r: -r[1]):
        lines.append(f"{label:48s} {mean:9.2f} {std:7.2f}   " + " ".join(f"{v:.2f}" for v in values))
    wins = int((trained > random_mean).sum())
    lines.append(f"trained selector beats random rule choice in {wins}/{len(seeds)} training seeds")
    lines.append("wall-clock seconds per fit: " + ", ".join(f"{runs[s]['fit_seconds']:.0f}" for s in seeds))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--root", type=Path, default=Path("runs/rbrl_results"))
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    tables = [table(Path(c).stem, {s: run(c, s, args.root) for s in args.seeds}) for c in args.configs]
    print("\n\n" + "\n\n".join(tables))
