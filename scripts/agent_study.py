"""RL on the bundled agent tasks against their SFT start: held-out episode success per seed (issue 43).

Each task has its SFT start and two arms, configs of ``flowkit fit`` over its episodes: ``long_addition`` (the tool
task, from ``bundled:tiny_tool_adder``: configs/grpo_tools_tiny.yaml, configs/rlfr_tools_tiny.yaml) and
``guess_number`` (the stateful game, from ``bundled:tiny_guesser``: configs/grpo_guess_tiny.yaml,
configs/rlfr_guess_tiny.yaml). A run is ``flowkit fit --config <arm> --seed_everything <seed>`` into
``--out-dir/<task>/<arm>_s<seed>``; its exported policy and the SFT start are measured by ``scripts/eval_episodes.py``
(``flowkit.agents.evaluate.episode_success``: ``--samples`` episodes per record on the first ``--records`` test
records at T = 1, evaluation seed 0, the same for every model). Rows are appended per finished run to
``--out-dir/<task>/results.jsonl`` and a finished run is skipped, so the study resumes and seeds can be added later.
The markdown table goes to stdout; ``--curves PNG`` also draws each run's training-time success and truncation per
step (the step's episodes at T = 1, a 5-step moving mean) with the SFT start's held-out success::

    python scripts/agent_study.py --task guess_number --arms grpo rlfr --seeds 0 1 2 --records 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = {  # environment: (SFT start, {arm: config})
    "long_addition": ("bundled:tiny_tool_adder",
                      {"grpo": "configs/grpo_tools_tiny.yaml", "rlfr": "configs/rlfr_tools_tiny.yaml"}),
    "guess_number": ("bundled:tiny_guesser",
                     {"grpo": "configs/grpo_guess_tiny.yaml", "rlfr": "configs/rlfr_guess_tiny.yaml"}),
}


def evaluate(model: str, environment: str, records: int, samples: int) -> dict[str, float]:
    """scripts/eval_episodes.py's metrics of ``model`` on the first ``records`` test records of ``environment``."""
    command = [sys.executable, str(ROOT / "scripts" / "eval_episodes.py"), "--model", model,
               "--environment", environment, "--records", str(records), "--samples", str(samples)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT).stdout)


def train(config: str, arm: str, seed: int, out_dir: Path) -> Path:
    """The exported policy of ``flowkit fit`` on ``config`` (arm ``arm``) with ``seed``."""
    run_dir = out_dir / f"{arm}_s{seed}"
    subprocess.run([sys.executable, "-m", "flowkit", "fit", "--config", config, "--seed_everything", str(seed),
                    "--trainer.default_root_dir", str(run_dir)], check=True, cwd=ROOT)
    return max(run_dir.glob("version_*/export/hf_policy"), key=os.path.getmtime)


def table(rows: list[dict]) -> str:
    """Held-out pass@1 and pass@k per seed and arm, with the SFT start's row first."""
    samples = rows[0]["samples"]
    lines = [f"| model | seed | pass@1 | pass@{samples} | truncated | tool-call errors |", "|---|---|---|---|---|---|"]
    for row in rows:
        seed = "-" if row["arm"] == "sft" else row["seed"]
        lines.append(f"| {row['arm']} | {seed} | {row['episodes/success_rate']:.4f} | "
                     f"{row[f'episodes/pass@{samples}']:.3f} | {row['episodes/truncated_rate']:.3f} | "
                     f"{row['episodes/tool_error_rate']:.3f} |")
    start = next(row["episodes/success_rate"] for row in rows if row["arm"] == "sft")
    for arm in sorted({row["arm"] for row in rows} - {"sft"}):
        gains = [row["episodes/success_rate"] - start for row in rows if row["arm"] == arm]
        if gains:
            spread = statistics.stdev(gains) if len(gains) > 1 else float("nan")
            lines.append(f"\n{arm}: pass@1 gain over the SFT start {statistics.mean(gains):+.4f} "
                         f"(per seed {', '.join(f'{g:+.4f}' for g in gains)}; seed spread (sd) {spread:.4f})")
    return "\n".join(lines)


def curves(out_dir: Path, rows: list[dict], path: Path) -> None:
    """Training-time success and truncation per step of every run under ``out_dir``, one line per arm and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    figure, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = {"grpo": "tab:blue", "rlfr": "tab:orange"}
    for run in sorted(out_dir.glob("*_s*")):
        arm, _, seed = run.name.rpartition("_s")
        frames = [pd.read_csv(f) for f in sorted(run.glob("version_*/metrics.csv"), key=os.path.getmtime)]
        if arm not in colors or not frames:
            continue
        metrics = pd.concat(frames).dropna(subset=["episodes/success_rate"]).groupby("step").last()
        for axis, name in zip(axes, ("episodes/success_rate", "episodes/truncated_rate"), strict=True):
            axis.plot(metrics.index, metrics[name].rolling(5, min_periods=1).mean(), color=colors[arm],
                      alpha=0.5 + 0.2 * int(seed) / 2, label=f"{arm} seed {seed}")
    start = next(row for row in rows if row["arm"] == "sft")
    for axis, name, title in zip(axes, ("episodes/success_rate", "episodes/truncated_rate"),
                                 ("success (training episodes, T = 1)", "truncated episodes"), strict=True):
        axis.axhline(start[name], color="black", linestyle="--", label="SFT start (held out)")
        axis.set(title=title, xlabel="RL step")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="long_addition", choices=sorted(TASKS))
    parser.add_argument("--arms", nargs="+", default=["grpo", "rlfr"], choices=["grpo", "rlfr"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--samples", type=int, default=4, help="episodes per test record")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/agent_study"))
    parser.add_argument("--curves", type=Path, help="also draw the runs' training curves into this PNG")
    args = parser.parse_args()

    start, configs = TASKS[args.task]
    out_dir = args.out_dir / args.task
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    rows = [row for row in rows if (row["records"], row["samples"]) == (args.records, args.samples)]
    done = {(row["arm"], row["seed"]) for row in rows}
    runs = [("sft", 0)] + [(arm, seed) for seed in args.seeds for arm in args.arms]
    for arm, seed in runs:
        if (arm, seed) in done:
            continue
        model = start if arm == "sft" else str(train(configs[arm], arm, seed, out_dir.resolve()))
        # the run's seed overrides the evaluation's (eval_episodes.py reports its own, always 0)
        row = {**evaluate(model, args.task, args.records, args.samples), "arm": arm, "seed": seed}
        with results.open("a") as stream:
            stream.write(json.dumps(row) + "\n")
        rows.append(row)
    print(table(sorted(rows, key=lambda row: (row["arm"] != "sft", row["arm"], row["seed"]))))
    if args.curves:
        curves(out_dir, rows, args.curves)


if __name__ == "__main__":
    main()
