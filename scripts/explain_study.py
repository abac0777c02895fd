"""Paired study on the bundled toy task (seed 000 §5): flow reward vs the paper's baselines that fit here.

    OMP_NUM_THREADS=1 python scripts/explain_study.py [--seeds 0 1 2] [--arms flow proxy sparse sft]

Every arm starts from the same SFT on the records' ``preferred`` explanations (``--sft-epochs``, paper: 3)
and then runs ``configs/explain_tiny.yaml`` (two rounds) with ``reward`` flow / proxy / sparse; ``sft`` stops
after the SFT. Each arm is then judged by ``flowkit validate``'s evaluation on the test split (``val/*``),
whose explanation accuracy comes from the held-out evaluator (``bundled:explain_tiny/proxy2``, not a
training proxy). Seeds pair the arms (same seed → same SFT data order, same initial LoRA). Prints mean ±
standard error over seeds per arm and the paired difference flow − sft; writes one JSON line per run to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from flowkit.cli import FlowkitCLI

ROOT = Path(__file__).resolve().parent.parent


def run(arm: str, seed: int, sft_epochs: int, tmp: Path) -> dict:
    reward = "flow" if arm == "sft" else arm
    args = ["--config", str(ROOT / "configs" / "explain_tiny.yaml"), "--seed_everything", str(seed),
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(tmp / f"{arm}_{seed}"), "--trainer.limit_val_batches", "1.0",
            "--model.init_args.reward", reward, "--model.init_args.sft_epochs", str(sft_epochs)]
    if arm == "sft":  # SFT happens in on_fit_start; no training batches means no round and no PPO
        args += ["--trainer.limit_train_batches", "0"]
    cli = FlowkitCLI(run=False, args=args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    (metrics,) = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    return {"arm": arm, "seed": seed, "sft_steps": len(cli.model.sft_losses),
            **{k: float(v) for k, v in metrics.items()}}


def mean_se(values: list[float]) -> str:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return f"{statistics.mean(values):.3f} ± {se:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=["flow", "proxy", "sparse", "sft"])
    parser.add_argument("--sft-epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/explain_study.jsonl"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        for arm in args.arms:
            row = run(arm, seed, args.sft_epochs, args.out.parent / "explain_study")
            results.append(row)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    by_arm = {arm: {r["seed"]: r for r in results if r["arm"] == arm} for arm in args.arms}
    for arm, rows in by_arm.items():
        line = f"{arm:>6}: explanation accuracy {mean_se([r['val/explanation_accuracy'] for r in rows.values()])}"
        if "val/reward_mean" in next(iter(rows.values())):
            line += f", flow reward mean {mean_se([r['val/reward_mean'] for r in rows.values()])}"
        print(line)
    if "flow" in by_arm and "sft" in by_arm:
        diffs = [by_arm["flow"][s]["val/explanation_accuracy"] - by_arm["sft"][s]["val/explanation_accuracy"]
                 for s in args.seeds]
        print(f"paired flow − sft explanation accuracy: {mean_se(diffs)} over {len(diffs)} seeds")


if __name__ == "__main__":
    main()
