"""RBRL results table: trained selector and numeric SAC / PPO vs uniform-random rule choice and each fixed rule.

Runs ``flowkit fit --config C --seed_everything S`` for every config C and training seed S, one after
the other, with the numeric baselines switched on (``--data.init_args.numeric_sac_steps`` and
``--data.init_args.numeric_ppo_transitions``; each fit prints its own table over the DataModule's
evaluation seeds and writes ``results.json`` and ``eval_curve.jsonl``), then prints one table per
environment. Rows that train (the trained selector, numeric SAC, numeric PPO) are mean ± std over
training seeds, each value that seed's mean over the evaluation seeds. Rows that do not train (uniform-
random rule choice, each fixed rule) give the same returns in every fit — the script checks this — so
they are mean ± std over evaluation seeds. Each table also says in how many training seeds the trained
selector beat uniform-random rule choice, and whether it is within one standard deviation (over training
seeds) of the best fixed rule. The tables go to ``<root>/results.md``; the learning curves (greedy
evaluation return every ``eval_interval`` steps, mean ± std over training seeds, with the random-rule and
best-fixed-rule levels) to ``<root>/rbrl_learning_curves.png`` (needs matplotlib: ``pip install 'flowkit[bench]'``).

    python scripts/rbrl_results.py                       # both environments, training seeds 0..4
    python scripts/rbrl_results.py --configs configs/rbrl_wearables.yaml --seeds 0 1 2
    python scripts/rbrl_results.py --numeric-sac-steps 0 --numeric-ppo-transitions 0   # rule policies only
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from flowkit.cli import main as flowkit_main

DEFAULT_CONFIGS = ["configs/rbrl_binpacking.yaml", "configs/rbrl_wearables.yaml"]


def run(config: str, seed: int, root: Path, numeric_sac_steps: int, numeric_ppo_transitions: int, reuse: bool = False) -> dict:
    run_dir = root / Path(config).stem / f"seed{seed}"
    timing = run_dir / "fit_seconds.json"
    if not (reuse and any(run_dir.glob("**/results.json"))):
        start = time.monotonic()
        flowkit_main([
            "fit", "--config", config, "--seed_everything", str(seed), "--trainer.default_root_dir", str(run_dir),
            "--data.init_args.numeric_sac_steps", str(numeric_sac_steps),
            "--data.init_args.numeric_ppo_transitions", str(numeric_ppo_transitions),
        ])
        timing.write_text(json.dumps(time.monotonic() - start))
    seconds = json.loads(timing.read_text()) if timing.is_file() else float("nan")
    newest = max(run_dir.glob("**/results.json"), key=lambda p: p.stat().st_mtime)
    curve_file = newest.parent / "eval_curve.jsonl"
    curve = [json.loads(line) for line in curve_file.read_text().splitlines()] if curve_file.is_file() else []
    return json.loads(newest.read_text()) | {"fit_seconds": seconds, "curve": curve}


NOT_POLICIES = ("eval_seeds", "fit_seconds", "curve")


def training_free(policy: str) -> bool:
    """Rule choices that do not train: their episodes depend only on the evaluation seeds."""
    return policy == "random rule" or policy.startswith("fixed: ")


def baselines(first_run: dict) -> dict[str, np.ndarray]:
    """The training-free rows' per-evaluation-seed returns."""
    return {k: np.array(v) for k, v in first_run.items() if k not in NOT_POLICIES and training_free(k)}


def trained_rows(runs: dict[int, dict]) -> dict[str, np.ndarray]:
    """Each trained row's mean over evaluation seeds, one value per training seed (sorted seeds); a row
    missing from some fit (e.g. numeric baselines switched off there) is an error, not a shorter row."""
    seeds = sorted(runs)
    names = [k for k in runs[seeds[0]] if k not in NOT_POLICIES and not training_free(k)]
    for s in seeds:
        found = sorted(k for k in runs[s] if k not in NOT_POLICIES and not training_free(k))
        if found != sorted(names):
            raise ValueError(f"training seed {s} has the trained rows {found}, training seed {seeds[0]} has {sorted(names)}")
    return {k: np.array([np.mean(runs[s][k]) for s in seeds]) for k in names}


def check_training_free_rows_agree(runs: dict[int, dict]) -> None:
    """The training-free rows are reported once, over evaluation seeds: every fit must have produced the
    same returns for them, else their spread over training seeds would be hidden."""
    seeds = sorted(runs)
    reference = baselines(runs[seeds[0]])
    for s in seeds[1:]:
        other = baselines(runs[s])
        if set(other) != set(reference) or any(not np.allclose(other[k], reference[k]) for k in reference):
            raise ValueError(f"training-free rows differ between training seeds {seeds[0]} and {s}")


def table(name: str, runs: dict[int, dict]) -> str:
    seeds = sorted(runs)
    check_training_free_rows_agree(runs)
    per_seed = trained_rows(runs)
    trained = per_seed["trained selector"]
    first = runs[seeds[0]]
    others = baselines(first)
    random_mean = others["random rule"].mean()
    std = lambda v: float(v.std(ddof=1)) if len(v) > 1 else 0.0
    rows = [(f"{k} ({len(seeds)} training seeds)", v.mean(), std(v), v) for k, v in per_seed.items()]
    rows += [(f"{k} ({len(v)} eval seeds)", v.mean(), std(v), v) for k, v in others.items()]
    lines = [
        f"== {name}: mean episode return ± std; evaluation seeds {first['eval_seeds']}",
        f"{'policy':56s} {'mean':>9s} {'± std':>7s}   values",
    ]
    for label, mean, spread, values in sorted(rows, key=lambda r: -r[1]):
        lines.append(f"{label:56s} {mean:9.3f} {spread:7.3f}   " + " ".join(f"{v:.3f}" for v in values))
    wins = int((trained > random_mean).sum())
    lines.append(f"trained selector beats random rule choice in {wins}/{len(seeds)} training seeds")
    fixed = {k: v.mean() for k, v in others.items() if k.startswith("fixed: ")}
    if fixed:
        # one std: the larger of the trained selector's spread over training seeds and the best fixed
        # rule's spread over evaluation seeds (the precision its own mean is known to)
        best = max(fixed, key=fixed.get)
        tolerance = max(std(trained), std(others[best]))
        within = trained.mean() >= fixed[best] - tolerance
        lines.append(
            f"best fixed rule {best[len('fixed: '):]} {fixed[best]:.3f} ± {std(others[best]):.3f}; trained selector "
            f"{trained.mean():.3f} ± {std(trained):.3f}: {'within' if within else 'NOT within'} one std ({tolerance:.3f}) of it or above"
        )
    lines.append("wall-clock seconds per fit: " + ", ".join(f"{runs[s]['fit_seconds']:.0f}" for s in seeds)
                 + " (nan: not recorded)")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--root", type=Path, default=Path("runs/rbrl_results"))
    parser.add_argument("--numeric-sac-steps", type=int, default=256,
                        help="numeric SAC training steps per fit, as the selector's 256 (0: no numeric SAC row)")
    parser.add_argument("--numeric-ppo-transitions", type=int, default=16384,
                        help="numeric PPO environment transitions per fit (0: no numeric PPO row)")
    parser.add_argument("--reuse", action="store_true", help="read runs already under --root instead of fitting again")
    return parser.parse_args()


def plot_curves(all_runs: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_runs), figsize=(5.5 * len(all_runs), 3.8), squeeze=False)
    for ax, (name, runs) in zip(axes[0], all_runs.items()):
        curves = [r["curve"] for r in runs.values() if r["curve"]]
        length = min(len(c) for c in curves)
        steps = np.array([p["step"] for p in curves[0][:length]])
        returns = np.array([[p["episode_return"] for p in c[:length]] for c in curves])
        mean = returns.mean(0)
        spread = returns.std(0, ddof=1) if len(curves) > 1 else np.zeros(length)
        ax.plot(steps, mean, marker="o", label=f"trained selector, greedy, 4 fixed curve episodes ({len(curves)} seeds, ± std)")
        ax.fill_between(steps, mean - spread, mean + spread, alpha=0.25)
        others = baselines(next(iter(runs.values())))
        fixed = {k: v.mean() for k, v in others.items() if k.startswith("fixed: ")}
        best = max(fixed, key=fixed.get)
        # the levels are means over the (other, more numerous) end-of-fit evaluation episodes
        ax.axhline(others["random rule"].mean(), color="grey", linestyle="--", label="uniform-random rule (evaluation seeds)")
        ax.axhline(fixed[best], color="green", linestyle=":", label=f"best fixed rule {best[len('fixed: '):]} (evaluation seeds)")
        ax.set(title=name, xlabel="training step (4 env steps + 8 SAC updates)", ylabel="episode return")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    args = parse_args()
    all_runs = {
        Path(c).stem: {s: run(c, s, args.root, args.numeric_sac_steps, args.numeric_ppo_transitions, args.reuse) for s in args.seeds}
        for c in args.configs
    }
    tables = [table(name, runs) for name, runs in all_runs.items()]
    args.root.mkdir(parents=True, exist_ok=True)
    (args.root / "results.md").write_text("```\n" + "\n\n".join(tables) + "\n```\n")
    plot_curves(all_runs, args.root / "rbrl_learning_curves.png")
    print("\n\n" + "\n\n".join(tables))
    print(f"\nwrote {args.root / 'results.md'} and {args.root / 'rbrl_learning_curves.png'}")
