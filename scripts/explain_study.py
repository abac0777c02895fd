"""Paired study of the explanation reward (seed 000 §5) on the bundled toy tasks: the flow vs its proxies.

    OMP_NUM_THREADS=1 python scripts/explain_study.py [--toys tiny noisy] [--seeds 0 1 2 3 4]
        [--arms flow proxy proxy0 proxy1 proxy2 sparse sft] [--out runs/explain_study.jsonl]

Every arm starts from the same SFT on the records' ``preferred`` explanations (``--sft-epochs``, paper: 3) and then
runs the toy's config, ``configs/explain_tiny.yaml`` or that with the delta ``configs/explain_noisy.yaml`` over it
(two rounds of flow fitting and PPO; the delta sets only the proxies), with:

- ``flow``: the flow's sentence rewards + its sparse reward (the paper's method), fitted on the union of the
  proxies' accepted explanations;
- ``proxy``: sentence rewards from the mean of the proxies' probabilities (the paper's proxy baseline);
- ``proxyK``: the same from proxy K alone (the flow's premise: it denoises several imperfect proxies);
- ``sparse``: the sparse reward only;
- ``sft``: the SFT alone (no RL).

``--toys``: ``tiny`` uses its config's proxies (bundled ``explain_tiny/proxy0..1``, each trained on the implied
decision with 10 % label noise); ``noisy`` the three noisy, disagreeing proxies ``explain_noisy/proxy0..2`` (each
misreads one decision, 30 % label noise; their model card). Accuracy is judged on the 96 test contexts by the
held-out evaluator ``explain_tiny/proxy2`` (not a training proxy). Seeds pair the arms (same seed → same SFT data
order, same initial LoRA, same sampling stream). One JSON line per run is appended to ``--out``; a run already there
is skipped (the study resumes); a row holds the ``val/heldout/*`` metrics of a ``validate`` after the fit, the
``final/*`` metrics the rounds' callback logged after the last RL step (another sample of explanations from the same
policy; absent for ``sft``) and ``wall_s``, the run's wall time. Prints mean ± standard error over seeds per (toy, arm)
and the paired differences of ``flow`` to every other arm, then the same as Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import yaml

from flowkit.cli import FlowkitCLI

ROOT = Path(__file__).resolve().parent.parent
PROXIES = {"tiny": [f"bundled:explain_tiny/proxy{i}" for i in (0, 1)],
           "noisy": [f"bundled:explain_noisy/proxy{i}" for i in (0, 1, 2)]}
# Each toy's config files, the base first: explain_noisy.yaml is a delta over explain_tiny.yaml
CONFIGS = {"tiny": [ROOT / "configs" / "explain_tiny.yaml"],
           "noisy": [ROOT / "configs" / "explain_tiny.yaml", ROOT / "configs" / "explain_noisy.yaml"]}
ACCURACY = "val/heldout/explanation_accuracy"


def check_configs() -> None:
    """Each toy's config trains with the proxies the study assumes (the ``flow`` and ``proxy`` arms use them all)."""
    for toy, paths in CONFIGS.items():
        path = paths[-1]  # the file that sets the toy's proxies
        proxies = yaml.safe_load(path.read_text())["model"]["init_args"]["reward_model"]["init_args"]["proxies"]
        if proxies != PROXIES[toy]:
            raise SystemExit(f"{path} trains with {proxies}, the study expects {PROXIES[toy]}")


def arm_options(toy: str, arm: str) -> list[str]:
    proxies = PROXIES[toy]
    reward = {"flow": "flow", "sparse": "sparse", "sft": "flow"}.get(arm, "proxy")
    if arm.startswith("proxy") and arm != "proxy":
        proxies = [proxies[int(arm.removeprefix("proxy"))]]
    return ["--model.init_args.reward_model.init_args.reward", reward,
            "--model.init_args.reward_model.init_args.proxies", json.dumps(proxies)]


def run(toy: str, arm: str, seed: int, sft_epochs: int, tmp: Path) -> dict:
    start = time.perf_counter()
    args = [*(arg for path in CONFIGS[toy] for arg in ("--config", str(path))), "--seed_everything", str(seed),
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(tmp / f"{toy}_{arm}_{seed}"), "--trainer.limit_val_batches", "1.0",
            "--data.init_args.val_batch_size", "96", "--model.init_args.sft.epochs", str(sft_epochs),
            *arm_options(toy, arm)]
    if arm == "sft":  # the SFT start runs in on_fit_start; no RL step follows
        args += ["--trainer.max_steps", "0"]
    cli = FlowkitCLI(run=False, args=args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    final = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("final/")}
    (metrics,) = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    return {"toy": toy, "arm": arm, "seed": seed, "sft_steps": len(cli.model.sft_losses),
            "global_step": cli.trainer.global_step, **{k: float(v) for k, v in metrics.items()}, **final,
            "wall_s": round(time.perf_counter() - start, 1)}


def mean_se(values: list[float]) -> str:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return f"{statistics.mean(values):.3f} ± {se:.3f}"


def report(results: list[dict], toys: list[str], arms: list[str]) -> None:
    for toy in toys:
        by_arm = {arm: {r["seed"]: r for r in results if r["toy"] == toy and r["arm"] == arm} for arm in arms}
        print(f"toy {toy}:")
        for arm, rows in by_arm.items():
            if rows:
                print(f"  {arm:>7}: explanation accuracy {mean_se([r[ACCURACY] for r in rows.values()])} "
                      f"({len(rows)} seeds)")
        flow = by_arm.get("flow", {})
        for arm, rows in by_arm.items():
            seeds = sorted(set(flow) & set(rows))
            if arm != "flow" and seeds:
                diffs = [flow[s][ACCURACY] - rows[s][ACCURACY] for s in seeds]
                print(f"  flow − {arm}: {mean_se(diffs)} over {len(seeds)} paired seeds")
    for toy in toys:  # the README's tables
        by_arm = {arm: {r["seed"]: r for r in results if r["toy"] == toy and r["arm"] == arm} for arm in arms}
        flow = by_arm.get("flow", {})
        print(f"\ntoy {toy}:\n\n| arm | seeds | explanation accuracy | flow − arm (paired) |\n|---|---|---|---|")
        for arm, rows in by_arm.items():
            if not rows:
                continue
            seeds = sorted(set(flow) & set(rows))
            paired = ("" if arm == "flow" or not seeds else
                      mean_se([flow[s][ACCURACY] - rows[s][ACCURACY] for s in seeds])
                      + ("" if len(seeds) == len(rows) else f" ({len(seeds)} seeds)"))
            print(f"| {arm} | {len(rows)} | {mean_se([r[ACCURACY] for r in rows.values()])} | {paired} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toys", nargs="+", default=["tiny", "noisy"], choices=sorted(PROXIES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--arms", nargs="+", default=["flow", "proxy", "proxy0", "proxy1", "proxy2", "sparse", "sft"])
    parser.add_argument("--sft-epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/explain_study.jsonl"))
    args = parser.parse_args()
    check_configs()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
    for seed in args.seeds:
        for toy in args.toys:
            for arm in args.arms:
                if arm.startswith("proxy") and arm != "proxy" and int(arm.removeprefix("proxy")) >= len(PROXIES[toy]):
                    continue  # the tiny toy has two training proxies
                if any((r["toy"], r["arm"], r["seed"]) == (toy, arm, seed) for r in done):
                    continue
                row = run(toy, arm, seed, args.sft_epochs, args.out.parent / "explain_study")
                done.append(row)
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    report(done, args.toys, args.arms)


if __name__ == "__main__":
    main()
