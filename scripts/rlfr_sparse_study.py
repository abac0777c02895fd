"""Where the flow reward should help: a paired study on the sparse-outcome task (issue 25).

The successor of ``scripts/rlfr_ablation.py`` for ``flowkit.data.long_addition``: from the bundled ``long_adder``
policy, which is right in a few samples at T = 1, most GRPO groups of 8 are all wrong and their outcome advantage is
zero; a dense reward is the only signal inside them. Arms (``--arms`` picks a subset):

- ``grpo``: configs/grpo_sparse.yaml, no flow;
- ``rlfr``: configs/rlfr_sparse.yaml as configured (β = 0.01); ``rlfr_b0.05``, ``rlfr_b0.2``: β = 0.05 / 0.2;
- ``entropy_adv``: plain GRPO plus the logit-space baseline of RLFR Table 2 (Cheng et al. 2025, "Entropy Adv.",
  :func:`flowkit.rl.advantages.entropy_shaped_advantages`, α = 0.4, κ = 2).
- ``rlfr_official``: ``rlfr`` with the official script's online protocol (``flow_update: micro_batch``: a flow step
  every RL step on the masked mean per micro-batch, correct rollouts weigh 1, the others ``soft_weight`` 0;
  ``update.micro_batch_size`` 1 as in configs/rlfr_qwen_official.yaml: the masked mean's group is one rollout);
- ``grpo_dynamic``: ``grpo`` with DAPO's dynamic sampling (groups whose 8 outcomes are all equal are dropped and
  more prompts drawn, at most 4 generations per step), the baseline a DAPO user would run. Its step-1 reward is
  over the groups it kept, so the pairing check below reports it as differing.

Every arm of a seed runs `flowkit fit` with ``seed_everything = seed``: the same prompt order and the same sampling
stream at step 1 (checked: step 1's outcome reward is identical in every arm of a seed). Every ``--eval-every`` RL
steps (and before the first) the policy is evaluated on ``--eval-prompts`` test prompts with ``--eval-samples``
samples each at T = 1 and greedily, under one common evaluation seed, with the training RNG saved and restored
around it (evaluation does not move the run's sampling stream): pass@1 and pass@k (unbiased estimator), the
fraction of prompts whose first 8 samples are all wrong (a GRPO group without signal, 1 − pass@8 on these prompts),
and, for flow arms, the flow's AUROC at the first wrong token of the policy's own wrong samples against correct
samples at the same response position (the own-sample measure of benchmarks/bench_reward_signal.py, with its
``score`` and ``auroc``), beside the policy's own surprisal −log π as a reference.

Rows are appended per finished run to ``--results`` (JSONL; a run interrupted half-way is rerun from its start), so
the study resumes where it stopped and seeds can be added later; rows of another setting are kept but not mixed in.
Several processes may share one results file (one ``write`` per row; each reads it before every run and skips what is
finished, so give them disjoint ``--arms`` or ``--seeds``, or opposite seed orders, to keep them off the same run).
The markdown table (paired differences to GRPO, mean ± standard error over seeds) goes to stdout and
``--out-dir``/table.md, the learning curves (mean over seeds with 95 % t-intervals) to ``--out-dir``/curves.png::

    python scripts/rlfr_sparse_study.py --seeds 0 1 2 3 4 --arms grpo rlfr rlfr_b0.05 rlfr_b0.2 entropy_adv
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks.bench_reward_signal: the own-sample scoring and AUROC

from benchmarks.bench_reward_signal import auroc, score  # noqa: E402
from flowkit.data.long_addition import DEFAULT_OPERANDS, OPERAND_COUNTS, max_new_tokens  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from make_long_adder import pass_at_k, read_jsonl  # noqa: E402

FLOW = "--model.init_args.reward_model.init_args."
ARMS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("grpo_sparse.yaml", []),
    "rlfr": ("rlfr_sparse.yaml", []),
    "rlfr_b0.05": ("rlfr_sparse.yaml", [FLOW + "scoring.beta", "0.05"]),
    "rlfr_b0.2": ("rlfr_sparse.yaml", [FLOW + "scoring.beta", "0.2"]),
    "entropy_adv": ("grpo_sparse.yaml", ["--model.init_args.advantage.entropy_alpha", "0.4",
                                         "--model.init_args.advantage.entropy_kappa", "2.0"]),
    "rlfr_official": ("rlfr_sparse.yaml", [FLOW + "online.flow_update", "micro_batch",
                                           FLOW + "online.soft_weight", "0.0",
                                           "--model.init_args.update.micro_batch_size", "1"]),
    "grpo_dynamic": ("grpo_sparse.yaml", ["--model.init_args.controls.dynamic_sampling_max_draws", "4"]),
}
GROUP = 8  # the configs' num_samples: a group whose 8 samples are all wrong has zero outcome advantage


def first_wrong_aurocs(scores: dict[str, torch.Tensor], responses: list[str], solutions: list[str],
                       correct: torch.Tensor) -> dict[str, float]:
    """AUROC of each metric (``deviation``, ``reward`` as the penalty −r, ``surprisal``) at a wrong sample's first
    wrong token (first character unlike the expert solution) against the correct samples' tokens at the same
    response position, pooled as benchmarks/bench_reward_signal.py's own-sample table pools them."""
    lengths = (scores["deviation"] != 0).sum(-1)  # scored response tokens, as the benchmark counts them
    result = {}
    for metric, sign in (("deviation", 1.0), ("reward", -1.0), ("surprisal", 1.0)):
        # row b's response position j sits at column start_b + j
        values = sign * scores[metric]
        positive, negative = [], []
        for b in (~correct).nonzero().flatten().tolist():
            k = next((i for i, (a, e) in enumerate(zip(responses[b], solutions[b])) if a != e),
                     min(len(responses[b]), len(solutions[b])))
            positive.append(values[b, scores["start"][b] + k])
            peers = (correct & (lengths > k)).nonzero().flatten()
            negative.append(values[peers, scores["start"][peers] + k])
        result[metric] = auroc(torch.stack(positive) if positive else torch.zeros(0),
                               torch.cat(negative) if negative else torch.zeros(0))
    return result


class HeldOutEvaluation(Callback):
    """Evaluates the policy before the first RL step and every ``every`` steps (see the module docstring)."""

    def __init__(self, records: list[dict], samples: int, every: int, seed: int):
        self.records, self.samples, self.every, self.seed = records, samples, every, seed
        self.steps, self.rows = 0, []

    def on_train_start(self, trainer, module) -> None:  # the flow is pretrained by now (PolicyModule.setup)
        self.rows.append(self.evaluate(module))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.steps += 1
        if self.steps % self.every == 0 or self.steps == trainer.max_steps:
            self.rows.append(self.evaluate(module))

    @torch.no_grad()
    def evaluate(self, module) -> dict:
        from flowkit.data.grader import grade

        started, rng = time.perf_counter(), torch.get_rng_state()
        prompts, answers = [r["prompt"] for r in self.records], [r["answer"] for r in self.records]
        torch.manual_seed(self.seed)
        sampled = module.engine.generate(prompts, self.samples, answers, temperature=1.0)
        greedy = module.engine.generate(prompts, 1, answers, temperature=0.0)
        correct = torch.tensor([grade(r, a) for r, a in zip(sampled.responses, sampled.answers)])
        hits = correct.view(len(prompts), self.samples)
        greedy_hits = [grade(r, a) for r, a in zip(greedy.responses, greedy.answers)]
        row = {"step": self.steps, "greedy": sum(greedy_hits) / len(prompts),
               "all_wrong": 1.0 - pass_at_k(hits[:, :GROUP], GROUP)}
        row.update({f"pass@{k}": pass_at_k(hits, k) for k in sorted({1, 4, GROUP, self.samples}) if k <= self.samples})
        if module.reward_model is not None:
            was_training = module.policy.training
            module.policy.eval()
            scores = score(module.policy, module.tokenizer, module.tap, module.reward_model, sampled.prompts,
                           sampled.responses, self.seed)
            module.policy.train(was_training)
            solutions = [r["solution"] for r in self.records for _ in range(self.samples)]
            row.update({f"auroc_{k}": v for k, v in
                        first_wrong_aurocs(scores, sampled.responses, solutions, correct).items()})
        torch.set_rng_state(rng)
        row["eval_s"] = time.perf_counter() - started
        print(f"  step {self.steps}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "step"), flush=True)
        return row


def train(arm: str, seed: int, args) -> dict:
    """`flowkit fit` of one arm with held-out evaluations → the run's result row."""
    from flowkit.cli import FlowkitCLI

    config, overrides = ARMS[arm]
    k = args.difficulty
    data = f"bundled:long_addition/k{k}/"
    cli_args = ["--config", str(ROOT / "configs" / config), "--seed_everything", str(seed),
                "--trainer.limit_val_batches", "0", "--trainer.max_steps", str(args.max_steps),
                "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                "--data.init_args.train_path", data + "train.jsonl", "--data.init_args.val_path", data + "val.jsonl",
                "--model.init_args.sampling.max_new_tokens", str(max_new_tokens(k)), *overrides]
    records = read_jsonl(ROOT / "flowkit/assets/long_addition" / f"k{k}" / "test.jsonl")[:args.eval_prompts]
    evaluation = HeldOutEvaluation(records, args.eval_samples, args.eval_every, args.eval_seed)
    here, started = os.getcwd(), time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        os.chdir(run_dir)
        try:
            cli = FlowkitCLI(args=cli_args, run=False)
            cli.trainer.callbacks.append(evaluation)
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
            with open(Path(cli.trainer.logger.log_dir) / "metrics.csv") as f:
                logged = [r for r in csv.DictReader(f) if r.get("train/outcome_reward")]
        finally:
            os.chdir(here)
    return {"arm": arm, "seed": seed, "wall_s": time.perf_counter() - started,
            "first_step_reward": float(logged[0]["train/outcome_reward"]),
            "train_accuracy": [float(r["train/accuracy"]) for r in logged], "evals": evaluation.rows}


def read_runs(path: Path, setting: dict) -> list[dict]:
    """The finished runs of ``setting`` in the results file (another setting's runs are not paired with these)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r["setting"] == setting]


def append_line(path: Path, line: str) -> None:
    """One ``write`` on an O_APPEND descriptor: study processes with disjoint ``--arms`` or ``--seeds`` can share
    one results file without interleaving their rows."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------- report
def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _se(values: list[float]) -> float:
    if len(values) < 2:
        return float("nan")
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def _t95(n: int) -> float:
    """Two-sided 95 % quantile of Student's t with n − 1 degrees of freedom (n ≥ 2; the normal's from n = 11 on,
    an interval up to 12 % too narrow at n = 11)."""
    return {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}.get(n, 1.96)


def final(row: dict, metric: str) -> float:
    return row["evals"][-1][metric]


def area(row: dict, metric: str) -> float:
    """Mean of ``metric`` over the run's evaluations after step 0 (how early an arm improves, not only where it
    ends)."""
    return _mean([e[metric] for e in row["evals"][1:]])


def paired_table(runs: list[dict], arms: list[str], samples: int) -> str:
    """Markdown: per arm and metric, the arm's mean over seeds and the mean ± SE of its paired difference to GRPO."""
    by = {(r["arm"], r["seed"]): r for r in runs}
    columns = [("pass@1", final, "pass@1"), (f"pass@{samples}", final, f"pass@{samples}"),
               ("all 8 wrong", final, "all_wrong"), ("greedy", final, "greedy"),
               ("pass@1, mean over evals", area, "pass@1")]
    header = ("| arm | seeds | " + " | ".join(f"{name} | Δ vs GRPO" for name, _, _ in columns)
              + " | AUROC first wrong token (start → end) | seeds won (final pass@1 above GRPO's) |")
    lines = [header, "|" + "---|" * (2 * len(columns) + 4)]
    for arm in arms:
        seeds = sorted(s for (a, s) in by if a == arm)
        if not seeds:
            continue
        cells, paired = [arm, str(len(seeds))], [s for s in seeds if ("grpo", s) in by]
        for _, how, metric in columns:
            cells.append(f"{_mean([how(by[(arm, s)], metric) for s in seeds]):.3f}")
            diffs = [how(by[(arm, s)], metric) - how(by[("grpo", s)], metric) for s in paired]
            cells.append("–" if arm == "grpo" or not diffs else f"{_mean(diffs):+.3f} ± {_se(diffs):.3f}")
        flows = [by[(arm, s)]["evals"] for s in seeds if "auroc_deviation" in by[(arm, s)]["evals"][0]]
        start, end = (_mean([e[i]["auroc_deviation"] for e in flows]) for i in (0, -1)) if flows else (None, None)
        cells.append(f"{start:.3f} → {end:.3f}" if flows else "–")
        won = sum(final(by[(arm, s)], "pass@1") > final(by[("grpo", s)], "pass@1") for s in paired)
        cells.append("–" if arm == "grpo" or not paired else f"{won}/{len(paired)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(runs: list[dict], arms: list[str], samples: int, out: Path, title: str) -> None:
    """Learning curves: mean over seeds with 95 % t-intervals; the paired difference to GRPO in its own panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("pass@1 (T=1, held out)", "pass@1", False),
              (f"pass@{samples} (T=1, held out)", f"pass@{samples}", False),
              ("fraction of prompts with all 8 samples wrong", "all_wrong", False),
              ("Δ pass@1 vs GRPO (paired)", "pass@1", True),
              ("flow AUROC at the first wrong token (own samples)", "auroc_deviation", False),
              ("training accuracy (16 steps moving mean)", None, False)]
    figure, axes = plt.subplots(2, 3, figsize=(16, 8.5), constrained_layout=True)
    by = {(r["arm"], r["seed"]): r for r in runs}
    colors = dict(zip(arms, plt.rcParams["axes.prop_cycle"].by_key()["color"]))  # one colour per arm in every panel
    for ax, (name, metric, paired) in zip(axes.flat, panels):
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        for arm in arms:
            seeds = sorted(s for (a, s) in by if a == arm and (not paired or ("grpo", s) in by))
            if not seeds or (paired and arm == "grpo"):
                continue
            if metric is None:
                curves = [_moving_mean(by[(arm, s)]["train_accuracy"], 16) for s in seeds]
                steps = list(range(1, min(len(c) for c in curves) + 1))
            else:
                if metric not in by[(arm, seeds[0])]["evals"][0]:
                    continue
                steps = [e["step"] for e in by[(arm, seeds[0])]["evals"]]
                curves = [[e[metric] - (by[("grpo", s)]["evals"][i][metric] if paired else 0.0)
                           for i, e in enumerate(by[(arm, s)]["evals"])] for s in seeds]
            mean = [_mean([c[i] for c in curves]) for i in range(len(steps))]
            ax.plot(steps, mean, label=f"{arm} (n={len(seeds)})", color=colors[arm])
            if len(seeds) > 1:
                half = [_t95(len(seeds)) * _se([c[i] for c in curves]) for i in range(len(steps))]
                ax.fill_between(steps, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)],
                                color=colors[arm], alpha=0.15)
        if paired:
            ax.axhline(0.0, color="black", linewidth=0.8)
        ax.legend(fontsize=7)
    figure.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=90)
    plt.close(figure)


def _moving_mean(values: list[float], window: int) -> list[float]:
    return [_mean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--difficulty", type=int, default=DEFAULT_OPERANDS, choices=OPERAND_COUNTS,
                        help="operands per problem (the bundled policy's starting accuracy per k: its model card)")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--eval-samples", type=int, default=16)
    parser.add_argument("--eval-seed", type=int, default=1234)
    parser.add_argument("--results", default="runs/rlfr_sparse_study.jsonl")
    parser.add_argument("--out-dir", default="runs/rlfr_sparse_study")
    parser.add_argument("--report-only", action="store_true", help="write table and curves from the results alone")
    args = parser.parse_args()
    if args.eval_samples < GROUP:
        parser.error(f"--eval-samples must be ≥ {GROUP} (the all-wrong fraction is over groups of {GROUP})")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    setting = {"difficulty": args.difficulty, "max_steps": args.max_steps, "eval_every": args.eval_every,
               "eval_prompts": args.eval_prompts, "eval_samples": args.eval_samples, "eval_seed": args.eval_seed}
    arms = [] if args.report_only else args.arms
    for seed in args.seeds:
        for arm in arms:
            if (arm, seed) in {(r["arm"], r["seed"]) for r in read_runs(path, setting)}:  # read now: other processes
                continue
            print(f"run {arm} seed {seed} (k = {args.difficulty}, {args.max_steps} steps)", flush=True)
            row = {**train(arm, seed, args), "setting": setting}
            print(f"  {arm} seed {seed}: {row['wall_s']:.0f} s", flush=True)
            append_line(path, json.dumps(row))
    runs = [r for r in read_runs(path, setting) if r["seed"] in args.seeds]  # --seeds also picks what is reported
    for seed in args.seeds:  # pairing check: step 1 uses the same prompts, policy and sampling in every arm
        # except dynamic sampling, whose step-1 reward is over the groups it kept
        first = {r["first_step_reward"] for r in runs
                 if r["seed"] == seed and r["arm"] in args.arms and r["arm"] != "grpo_dynamic"}
        if first:
            print(f"seed {seed}: step-1 outcome reward {'identical' if len(first) == 1 else 'DIFFERS'} across arms "
                  f"{sorted(first)}")
    reported = ["grpo", *[a for a in args.arms if a != "grpo"]]  # the baseline's rows, wherever they came from
    table = paired_table(runs, reported, args.eval_samples)
    print(table)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n")
    plot_curves(runs, reported, args.eval_samples, out / "curves.png",
                f"sparse-outcome task, k = {args.difficulty} operands: mean over seeds, 95 % t-interval")
    print(f"wrote {out / 'table.md'} and {out / 'curves.png'}")


if __name__ == "__main__":
    main()
