"""RL on the bundled agent tasks against their SFT start: held-out episode success per seed (issue 43).

Each arm is a config of ``flowkit fit`` over episodes (``grpo``: configs/grpo_tools_tiny.yaml, ``rlfr``:
configs/rlfr_tools_tiny.yaml, both from ``bundled:tiny_tool_adder`` on ``long_addition``). A run is
``flowkit fit --config <arm> --seed_everything <seed>`` into ``--out-dir/<arm>_s<seed>``; its exported policy and the
SFT start are measured by ``scripts/eval_episodes.py`` (``flowkit.agents.evaluate.episode_success``: ``--samples``
episodes per record on the first ``--records`` test records at T = 1, evaluation seed 0, the same for every model).
Rows are appended per finished run to ``--out-dir/results.jsonl`` and a finished run is skipped, so the study resumes
and seeds can be added later. The markdown table goes to stdout::

    python scripts/agent_study.py --arms grpo rlfr --seeds 0 1 2 --records 100
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
ARMS = {"grpo": "configs/grpo_tools_tiny.yaml", "rlfr": "configs/rlfr_tools_tiny.yaml"}
START = "bundled:tiny_tool_adder"
ENVIRONMENT = "long_addition"


def evaluate(model: str, records: int, samples: int) -> dict[str, float]:
    """scripts/eval_episodes.py's metrics of ``model`` on the first ``records`` test records."""
    command = [sys.executable, str(ROOT / "scripts" / "eval_episodes.py"), "--model", model,
               "--environment", ENVIRONMENT, "--records", str(records), "--samples", str(samples)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT).stdout)


def train(arm: str, seed: int, out_dir: Path) -> Path:
    """The exported policy of ``flowkit fit`` on ``arm``'s config with ``seed``."""
    run_dir = out_dir / f"{arm}_s{seed}"
    subprocess.run([sys.executable, "-m", "flowkit", "fit", "--config", ARMS[arm], "--seed_everything", str(seed),
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
    for arm in ARMS:
        gains = [row["episodes/success_rate"] - start for row in rows if row["arm"] == arm]
        if gains:
            spread = statistics.stdev(gains) if len(gains) > 1 else float("nan")
            lines.append(f"\n{arm}: pass@1 gain over the SFT start {statistics.mean(gains):+.4f} "
                         f"(per seed {', '.join(f'{g:+.4f}' for g in gains)}; seed spread (sd) {spread:.4f})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=sorted(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--samples", type=int, default=4, help="episodes per test record")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/agent_study"))
    args = parser.parse_args()

    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = args.out_dir / "results.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    rows = [row for row in rows if (row["records"], row["samples"]) == (args.records, args.samples)]
    done = {(row["arm"], row["seed"]) for row in rows}
    runs = [("sft", 0)] + [(arm, seed) for seed in args.seeds for arm in args.arms]
    for arm, seed in runs:
        if (arm, seed) in done:
            continue
        model = START if arm == "sft" else str(train(arm, seed, args.out_dir.resolve()))
        # the run's seed overrides the evaluation's (eval_episodes.py reports its own, always 0)
        row = {**evaluate(model, args.records, args.samples), "arm": arm, "seed": seed}
        with results.open("a") as stream:
            stream.write(json.dumps(row) + "\n")
        rows.append(row)
    print(table(sorted(rows, key=lambda row: (row["arm"] != "sft", row["arm"], row["seed"]))))


if __name__ == "__main__":
    main()
