"""RBRL study: the trained selector against uniform-random rule choice, each fixed rule and the numeric SAC / PPO
baselines, over training seeds, with paired differences and the diagnostics that show a collapsed selector.

For every config C, arm A and training seed S it runs ``flowkit fit --config C --seed_everything S`` (plus the
arm's overrides) in ``<root>/<C>/<A>/seed<S>`` and appends one row — every policy's per-evaluation-seed mean
return, the selector's diagnostics and its learning curve — to ``<root>/rows.jsonl``. Rows already there are
skipped, so an interrupted study resumes where it stopped (an unfinished fit's directory is removed and the fit
run again). Arms:

- ``paper`` (the config as shipped: official SAC settings and run length, rule reward coefficient 0.1), which
  also trains the numeric baselines (``--numeric-sac-steps``, ``--numeric-ppo-transitions``; default: the
  selector's environment steps, the paper's "equal environment steps");
- ``no_rule_reward``: the same with ``rule_reward_coef: 0`` (environment reward only, no baselines), to tell
  whether the rule reward is what moves the selector;
- ``reward_x100``: the same with ``reward_scale: 100`` (the whole reward × 100, no baselines), to tell whether the
  entropy term outweighs the reward: bin packing's official 1/100 rewards make the Q differences between rules
  small beside α · log π.

Then, per config and arm, ``results.md`` gets a table of mean ± std episode returns (rows that train: over training
seeds, each value that seed's mean over the evaluation seeds; rows that do not train — fixed rules, random rule —
give the same returns in every fit, which the script checks, so their spread is over evaluation seeds), the paired
differences trained selector − each other policy (per training seed, on the same evaluation episodes; numeric
baselines paired by training seed) with their mean, std and 95 % t-interval over training seeds, and the collapse
diagnostics: the rules the greedy selector chose, its agreement with each fixed rule, greedy vs sampled return,
and the entropy of its rule choice at the first and last learning-curve evaluation. ``learning_curves.png``
(needs matplotlib) plots greedy and sampled returns and the rule-choice entropy over training.

    nice -n 10 python scripts/rbrl_results.py                            # both envs, seeds 0..4, all arms
    python scripts/rbrl_results.py --configs configs/rbrl_wearables.yaml --seeds 0 1 --arms paper
    python scripts/rbrl_results.py --report-only                         # tables and plot from rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np

DEFAULT_CONFIGS = ["configs/rbrl_binpacking.yaml", "configs/rbrl_wearables.yaml"]
ARMS = {"paper": [], "no_rule_reward": ["--model.init_args.rule_reward_coef", "0"],
        "reward_x100": ["--model.init_args.reward_scale", "100"]}
SELECTOR = "trained selector"
# t_{0.975, df} for the 95 % interval of a mean over n = df + 1 training seeds
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def run_fit(config: str, arm: str, seed: int, root: Path, numeric_sac_steps: int, numeric_ppo_transitions: int) -> dict:
    """One fit; returns its row."""
    from flowkit.cli import main as flowkit_main

    run_dir = root / Path(config).stem / arm / f"seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an interrupted fit: its row was never written
    baselines = arm == "paper"
    start = time.monotonic()
    flowkit_main([
        "fit", "--config", config, "--seed_everything", str(seed), "--trainer.default_root_dir", str(run_dir),
        "--data.init_args.numeric_sac_steps", str(numeric_sac_steps if baselines else 0),
        "--data.init_args.numeric_ppo_transitions", str(numeric_ppo_transitions if baselines else 0),
        *ARMS[arm],
    ])
    seconds = time.monotonic() - start
    version = max(run_dir.glob("version_*/results.json"), key=lambda p: p.stat().st_mtime).parent
    results = json.loads((version / "results.json").read_text())
    curve = [json.loads(line) for line in (version / "eval_curve.jsonl").read_text().splitlines()] \
        if (version / "eval_curve.jsonl").is_file() else []
    return {
        "config": Path(config).stem, "arm": arm, "seed": seed, "fit_seconds": seconds,
        "eval_seeds": results.pop("eval_seeds"), "diagnostics": results.pop("selector_diagnostics"),
        "llm_report": results.pop("llm_report", []),
        "returns": results, "curve": curve,
    }


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def training_free(policy: str) -> bool:
    """Rule choices that do not train: their episodes depend only on the evaluation seeds."""
    return policy == "random rule" or policy.startswith("fixed: ")


def std(values: np.ndarray) -> float:
    return float(values.std(ddof=1)) if len(values) > 1 else 0.0


def interval(values: np.ndarray) -> float:
    """Half-width of the 95 % t-interval of the mean (0 for one value)."""
    n = len(values)
    return T_975.get(n - 1, 1.96) * std(values) / math.sqrt(n) if n > 1 else 0.0


def training_free_rows(rows: list[dict]) -> dict[str, np.ndarray]:
    """The training-free policies' per-evaluation-seed returns, checked to agree across fits: they are reported
    once, over evaluation seeds, which would hide a spread over training seeds."""
    first = {k: np.array(v) for k, v in rows[0]["returns"].items() if training_free(k)}
    for row in rows[1:]:
        other = {k: np.array(v) for k, v in row["returns"].items() if training_free(k)}
        if set(other) != set(first) or any(not np.allclose(other[k], first[k]) for k in first):
            raise ValueError(f"training-free rows differ between training seeds {rows[0]['seed']} and {row['seed']}")
    return first


def trained_rows(rows: list[dict]) -> dict[str, np.ndarray]:
    """Each trained policy's mean over evaluation seeds, one value per training seed (rows sorted by seed); a
    policy missing from some fit is an error, not a shorter row."""
    names = sorted(k for k in rows[0]["returns"] if not training_free(k))
    for row in rows:
        found = sorted(k for k in row["returns"] if not training_free(k))
        if found != names:
            raise ValueError(f"training seed {row['seed']} has the trained rows {found}, training seed {rows[0]['seed']} has {names}")
    return {k: np.array([np.mean(row["returns"][k]) for row in rows]) for k in names}


def paired_differences(rows: list[dict]) -> dict[str, np.ndarray]:
    """Trained selector − each other policy, one value per training seed: against a training-free policy on the
    same evaluation episodes, against a trained baseline (numeric SAC / PPO) of the same training seed."""
    trained, fixed = trained_rows(rows), training_free_rows(rows)
    selector = trained[SELECTOR]
    diffs = {k: selector - v for k, v in trained.items() if k != SELECTOR}
    diffs |= {k: selector - v.mean() for k, v in fixed.items()}
    return diffs


def percent(shares: dict[str, float], top: int = 3) -> str:
    ranked = sorted(shares.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in ranked) or "-"


def table(name: str, rows: list[dict]) -> str:
    rows = sorted(rows, key=lambda r: r["seed"])
    seeds = [r["seed"] for r in rows]
    trained, fixed = trained_rows(rows), training_free_rows(rows)
    lines = [f"== {name}: episode return, mean ± std; training seeds {seeds}, evaluation seeds {rows[0]['eval_seeds']}",
             f"{'policy':56s} {'mean':>9s} {'± std':>7s}   values"]
    entries = [(f"{k} ({len(seeds)} training seeds)", v) for k, v in trained.items()]
    entries += [(f"{k} ({len(v)} eval seeds)", v) for k, v in fixed.items()]
    for label, values in sorted(entries, key=lambda e: -e[1].mean()):
        lines.append(f"{label:56s} {values.mean():9.3f} {std(values):7.3f}   " + " ".join(f"{v:.3f}" for v in values))

    lines += ["", f"paired difference trained selector − policy, over the {len(seeds)} training seeds",
              f"{'policy':40s} {'mean':>8s} {'± std':>7s} {'95% CI':>17s} {'wins':>5s}"]
    for policy, diff in sorted(paired_differences(rows).items(), key=lambda kv: kv[1].mean()):
        half = interval(diff)
        lines.append(f"{policy:40s} {diff.mean():8.3f} {std(diff):7.3f} [{diff.mean() - half:7.3f}, {diff.mean() + half:7.3f}]"
                     f" {int((diff > 0).sum())}/{len(diff)}")

    lines += ["", "collapse diagnostics per training seed (greedy selector on the evaluation episodes; curve: first → last "
              "learning-curve evaluation)"]
    for row in rows:
        d, curve = row["diagnostics"], row["curve"]
        same = d.get("same_as_fixed_rule") or []
        greedy, sampled = np.mean(row["returns"][SELECTOR]), np.mean(row["returns"].get(f"{SELECTOR} (sampled)", [np.nan]))
        entropy = f"{curve[0]['rule_entropy']:.2f} → {curve[-1]['rule_entropy']:.2f}" if curve else "-"
        curve_sampled = f"{curve[0]['sampled_return']:.3f} → {curve[-1]['sampled_return']:.3f}" if curve else "-"
        lines.append(
            f"seed {row['seed']}: greedy {greedy:.3f}, sampled {sampled:.3f}; rule entropy {entropy}; sampled curve "
            f"{curve_sampled}; chose {percent(d.get('chosen', {}))}; agrees with {percent(d.get('agreement', {}))}"
            + (f"; SAME AS FIXED RULE {', '.join(same)}" if same else "")
        )
    flagged = sum(bool(r["diagnostics"].get("same_as_fixed_rule")) for r in rows)
    lines.append(f"the trained selector behaved as a fixed rule in {flagged}/{len(rows)} training seeds")
    lines.append("wall-clock seconds per fit: " + ", ".join(f"{r['fit_seconds']:.0f}" for r in rows))
    return "\n".join(lines)


def plot_curves(groups: dict[tuple[str, str], list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(groups), figsize=(5.5 * len(groups), 7), squeeze=False)
    for column, ((config, arm), rows) in enumerate(groups.items()):
        curves = [r["curve"] for r in rows if r["curve"]]
        if not curves:
            continue
        length = min(len(c) for c in curves)
        steps = np.array([p["step"] for p in curves[0][:length]])
        top, bottom = axes[0][column], axes[1][column]
        for key, label in (("episode_return", "greedy"), ("sampled_return", "sampled")):
            values = np.array([[p[key] for p in c[:length]] for c in curves])
            spread = values.std(0, ddof=1) if len(curves) > 1 else np.zeros(length)
            top.plot(steps, values.mean(0), marker="o", markersize=3, label=f"selector, {label} ({len(curves)} seeds, ± std)")
            top.fill_between(steps, values.mean(0) - spread, values.mean(0) + spread, alpha=0.2)
        fixed = training_free_rows(rows)
        best = max((k for k in fixed if k.startswith("fixed: ")), key=lambda k: fixed[k].mean(), default=None)
        top.axhline(fixed["random rule"].mean(), color="grey", linestyle="--", label="uniform-random rule")
        if best:
            top.axhline(fixed[best].mean(), color="green", linestyle=":", label=f"best fixed rule {best[len('fixed: '):]}")
        top.set(title=f"{config} ({arm})", xlabel="training step (4 env steps + 8 SAC updates)", ylabel="episode return")
        top.legend(fontsize=7)
        entropy = np.array([[p["rule_entropy"] for p in c[:length]] for c in curves])
        bottom.plot(steps, entropy.mean(0), marker="o", markersize=3, color="purple", label="entropy of the rule choice (mean)")
        bottom.set(xlabel="training step", ylabel="nats")
        bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["paper", "no_rule_reward", "reward_x100"])
    parser.add_argument("--root", type=Path, default=Path("runs/rbrl_results"))
    parser.add_argument("--numeric-sac-steps", type=int, default=1216,
                        help="numeric SAC training steps in the paper arm, after its 256-transition warm-up (0: none)")
    parser.add_argument("--numeric-ppo-transitions", type=int, default=5120,
                        help="numeric PPO environment transitions in the paper arm (0: none)")
    parser.add_argument("--report-only", action="store_true", help="write the tables and plot from rows.jsonl, fit nothing")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    rows_file = args.root / "rows.jsonl"
    if not args.report_only:
        for config in args.configs:
            for arm in args.arms:
                for seed in args.seeds:
                    done = {(r["config"], r["arm"], r["seed"]) for r in read_rows(rows_file)}
                    if (Path(config).stem, arm, seed) in done:
                        continue
                    row = run_fit(config, arm, seed, args.root, args.numeric_sac_steps, args.numeric_ppo_transitions)
                    with rows_file.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in read_rows(rows_file):
        groups.setdefault((row["config"], row["arm"]), []).append(row)
    tables = [table(f"{config} ({arm})", rows) for (config, arm), rows in sorted(groups.items())]
    (args.root / "results.md").write_text("```\n" + "\n\n".join(tables) + "\n```\n")
    plot_curves(dict(sorted(groups.items())), args.root / "learning_curves.png")
    print("\n\n".join(tables))
    print(f"\nwrote {args.root / 'results.md'} and {args.root / 'learning_curves.png'}")


if __name__ == "__main__":
    main()
