"""Paired RLFR ablation on the bundled tiny task: plain GRPO vs RLFR as configured vs the paper's ablations.

Every arm of a seed runs `flowkit fit` with ``seed_everything = seed``: the same prompt order and the same
sampling RNG stream (the flow's initialisation runs on its own RNG and its noise is counter-based, so adding
a flow does not shift the policy's stream; the script checks that step 1's outcome reward is identical in every
arm of a seed). After training, each policy is evaluated on the test split with one common evaluation seed:
``--eval-samples`` samples per prompt at T = 1 (pass@1) and greedy decoding. The table reports, per arm, the
mean ± standard error over seeds of the paired difference to plain GRPO, and the arm's own mean.

Arms (configs/grpo_tiny.yaml and configs/rlfr_tiny.yaml plus overrides; ``--arms`` picks a subset):
``grpo``; ``rlfr`` (as configured); ``entropy`` / ``both`` (rejection metric); ``beta0`` (β = 0: the flow trains
but gives no reward — a control, not plain GRPO); ``p600`` / ``p600_entropy`` / ``p600_both`` (the pretraining of
the default before: 600 steps of official logit-normal(0, 1) timesteps); ``earlier`` (the tiny default before the
flow-signal study: P = 0.25/0.5/0.75, T = {0.8}, 150 pretraining steps) and, on that base, ``earlier_next``
(condition), ``earlier_bilateral``, ``earlier_T4`` (T = {0.2, 0.4, 0.6, 0.8}, debiased) and ``earlier_T4_nodebias``.

Results are appended per (arm, seed) to ``--results`` (JSONL), so an interrupted study resumes where it
stopped and more seeds can be added later; the markdown table goes to stdout and ``--table``::

    python scripts/rlfr_ablation.py --seeds 0 1 2 3 4 --arms grpo rlfr earlier earlier_next --table ablation.md
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
FLOW = "--model.init_args.reward_model.init_args."
# The tiny default before the flow-signal study (three tapped blocks, T = {0.8}, 150 pretraining steps): the
# condition / bilateral / timestep ablations were measured on it.
EARLIER = [FLOW + "latents.percentiles", "[0.25, 0.5, 0.75]", FLOW + "scoring.timesteps", "[0.8]",
           FLOW + "pretraining.pretrain_logit_mean", "0.0",
           "--model.init_args.flow_pretrain.steps", "150", "--model.init_args.flow_pretrain.cache_latents", "false"]
# The pretraining of the tiny default after the signal study and before the shifted timesteps (600 official steps).
P600 = ["--model.init_args.flow_pretrain.steps", "600", FLOW + "pretraining.pretrain_logit_mean", "0.0"]
T4 = [FLOW + "scoring.timesteps", "[0.2, 0.4, 0.6, 0.8]"]
ARMS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("grpo_tiny.yaml", []),
    "rlfr": ("rlfr_tiny.yaml", []),
    "entropy": ("rlfr_tiny.yaml", [FLOW + "online.rejection_metric", "entropy"]),
    "both": ("rlfr_tiny.yaml", [FLOW + "online.rejection_metric", "both"]),
    "beta0": ("rlfr_tiny.yaml", [FLOW + "scoring.beta", "0.0"]),
    "p600": ("rlfr_tiny.yaml", P600),
    "p600_entropy": ("rlfr_tiny.yaml", [*P600, FLOW + "online.rejection_metric", "entropy"]),
    "p600_both": ("rlfr_tiny.yaml", [*P600, FLOW + "online.rejection_metric", "both"]),
    "earlier": ("rlfr_tiny.yaml", EARLIER),
    "earlier_next": ("rlfr_tiny.yaml", [*EARLIER, FLOW + "latents.condition", "next"]),
    "earlier_bilateral": ("rlfr_tiny.yaml", [*EARLIER, FLOW + "scoring.normalization", "bilateral"]),
    "earlier_T4": ("rlfr_tiny.yaml", [*EARLIER, *T4]),
    "earlier_T4_nodebias": ("rlfr_tiny.yaml", [*EARLIER, *T4, FLOW + "scoring.debias", "false"]),
}


def train(arm: str, seed: int, max_steps: int | None):
    """`flowkit fit` of one arm in a scratch directory → (trained PolicyModule, per-step outcome rewards)."""
    from flowkit.cli import FlowkitCLI

    config, overrides = ARMS[arm]
    args = ["fit", "--config", str(ROOT / "configs" / config), "--seed_everything", str(seed),
            "--trainer.limit_val_batches", "0", *overrides]
    if max_steps is not None:
        args += ["--trainer.max_steps", str(max_steps)]
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as run_dir:
        os.chdir(run_dir)
        try:
            cli = FlowkitCLI(args=args)
            with open(Path(cli.trainer.logger.log_dir) / "metrics.csv") as f:
                rewards = [float(r["train/outcome_reward"]) for r in csv.DictReader(f) if r.get("train/outcome_reward")]
        finally:
            os.chdir(here)
    return cli.model, rewards


@torch.no_grad()
def evaluate(module, prompts: int, samples: int, seed: int) -> dict[str, float]:
    """pass@1 at T = 1 (``samples`` per prompt) and greedy accuracy on the test split, one common seed."""
    from flowkit.data.grader import grade
    from flowkit.data.records import load_records
    from flowkit.modules.datamodule import resolve_data_path

    records = load_records(resolve_data_path("bundled:arithmetic/test.jsonl"), ["prompt", "answer"])[:prompts]
    texts, answers = [r["prompt"] for r in records], [r["answer"] for r in records]
    module.eval()
    engine = module.engine
    results = {}
    for name, n, temperature in (("pass@1", samples, 1.0), ("greedy", 1, 0.0)):
        torch.manual_seed(seed)
        batch = engine.generate(texts, n, answers, temperature=temperature)
        results[name] = sum(grade(r, a) for r, a in zip(batch.responses, batch.answers)) / len(batch.responses)
    return results


def paired_table(results: list[dict], arms: list[str], baseline: str = "grpo") -> str:
    """Markdown: per arm, mean ± standard error over seeds of (arm − baseline), and the arm's own mean."""
    by = {(r["arm"], r["seed"]): r for r in results}
    lines = ["| arm | seeds | pass@1 (T=1) | Δ pass@1 vs GRPO | greedy | Δ greedy vs GRPO |",
             "|---|---|---|---|---|---|"]
    for arm in arms:
        seeds = sorted(s for (a, s) in by if a == arm)
        cells = [arm, str(len(seeds))]
        for metric in ("pass@1", "greedy"):
            own = [by[(arm, s)][metric] for s in seeds]
            cells.append(f"{_mean(own):.3f}" if own else "–")
            diffs = [by[(arm, s)][metric] - by[(baseline, s)][metric] for s in seeds if (baseline, s) in by]
            cells.append("–" if arm == baseline or not diffs else _mean_se(diffs))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _mean_se(values: list[float]) -> str:
    mean = _mean(values)
    if len(values) < 2:
        return f"{mean:+.3f} (n=1)"
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))
    return f"{mean:+.3f} ± {se:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--max-steps", type=int, default=None, help="RL steps (default: the configs' 60)")
    parser.add_argument("--eval-prompts", type=int, default=500)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--eval-seed", type=int, default=1234)
    parser.add_argument("--results", default="runs/rlfr_ablation.jsonl")
    parser.add_argument("--table", default=None, help="also write the markdown table here")
    args = parser.parse_args()
    if "grpo" not in args.arms:
        parser.error("the paired differences need the grpo arm")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    results = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    setting = {"max_steps": args.max_steps, "eval_prompts": args.eval_prompts, "eval_samples": args.eval_samples,
               "eval_seed": args.eval_seed}
    results = [r for r in results if r["setting"] == setting]  # another scale's rows are not paired with these
    done = {(r["arm"], r["seed"]) for r in results}
    for seed in args.seeds:
        for arm in args.arms:
            if (arm, seed) in done:
                continue
            module, rewards = train(arm, seed, args.max_steps)
            row = {"arm": arm, "seed": seed, "setting": setting, **evaluate(module, args.eval_prompts,
                                                                          args.eval_samples, args.eval_seed),
                   "first_step_reward": rewards[0], "train_reward_first10": _mean(rewards[:10]),
                   "train_reward_last10": _mean(rewards[-10:])}
            print(json.dumps(row), flush=True)
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            results.append(row)
    for seed in args.seeds:  # pairing check: step 1 uses the same prompts, policy and sampling in every arm
        first = {r["first_step_reward"] for r in results if r["seed"] == seed and r["arm"] in args.arms}
        print(f"seed {seed}: step-1 outcome reward {'identical' if len(first) == 1 else 'DIFFERS'} across arms {sorted(first)}")
    table = paired_table(results, args.arms)
    print(table)
    if args.table:
        Path(args.table).write_text(table + "\n")


if __name__ == "__main__":
    main()
