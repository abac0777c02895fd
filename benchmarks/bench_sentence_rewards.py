"""Sentence rewards of explanations with K sentences: one backbone pass vs one pass per prefix.

    python benchmarks/bench_sentence_rewards.py [--ks 4 8 16] [--rows 4] [--draws 8] [--steps 6]
    python benchmarks/bench_sentence_rewards.py --variance [--seeds 64] [--draws 8] [--steps 6]

Both paths compute the same z1 draws for the K + 1 prefixes of every explanation (tested equal in
tests/explain/test_sentence_rewards.py): the one-pass path encodes each explanation once and restricts
each prefix's flow tokens to keys [0, end_k); the per-prefix path re-encodes every truncated prefix.
Backbone: the bundled tiny explanation LLM (``flowkit/assets/explain_tiny/policy``). Prints median /
p20 / p80 wall time per path and K and the per-prefix / one-pass ratio of medians; appends rows to
benchmarks/results/results.csv.

``--variance`` measures the draw noise of Eq. 5's sentence rewards instead: a flow fitted for a few
hundred steps to per-row targets scores the same explanations (K = 4) under ``--seeds`` z0 seeds, with
the same M draws for every prefix of an explanation (common random numbers, the default of
``flow_sentence_rewards``) and with independent draws per prefix; it prints the variance over seeds of
r(s^k), averaged over sentences, for both, and their ratio (also appended to the CSV).
"""

from __future__ import annotations

import argparse

import torch

from flowkit.explain.context import encode_context
from flowkit.explain.flow_net import ExplanationFlow
from flowkit.explain.gridworld import make_records
from flowkit.explain.prompts import explanation_prompt
from flowkit.explain.reward_model import ExplanationFlowModel
from flowkit.explain.sentence_rewards import (
    flow_samples,
    flow_samples_per_prefix,
    flow_sentence_rewards,
    prefix_table,
    sentence_token_ends,
)
from flowkit.llm.backbone import load_backbone

try:
    from common import append_csv, measure, timestamp
except ImportError:  # run from the repo root as a module
    from benchmarks.common import append_csv, measure, timestamp


def explanation_rows(tokenizer, num_rows: int, num_sentences: int):
    """``num_rows`` (prompt + explanation of exactly ``num_sentences`` sentences) rows, right-padded."""
    records = make_records(num_rows * num_sentences, seed=0, kinds=(1.0, 0.0, 0.0))
    rows, ends, prompt_lengths = [], [], []
    for r in range(num_rows):
        chunk = records[r * num_sentences:(r + 1) * num_sentences]
        sentences = [rec["explanation"].split(". ")[0] + "." for rec in chunk]
        prompt_ids = tokenizer(explanation_prompt(chunk[0]["context"]))["input_ids"]
        response = tokenizer(" ".join(sentences), add_special_tokens=False)["input_ids"]
        rows.append(prompt_ids + response)
        ends.append(sentence_token_ends(tokenizer, response))
        prompt_lengths.append(len(prompt_ids))
        assert len(ends[-1]) == num_sentences
    length = max(map(len, rows))
    ids = torch.tensor([row + [tokenizer.pad_token_id] * (length - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in rows])
    return ids, mask, torch.tensor(prompt_lengths), ends


def reward_variance(args, backbone, tokenizer) -> None:
    """Variance over z0 seeds of r(s^k) with common vs independent draws per prefix (see module docstring)."""
    ids, mask, prompt_lengths, ends = explanation_rows(tokenizer, args.rows, 4)
    prefixes, prefix_mask = prefix_table(prompt_lengths, ends)
    model = ExplanationFlowModel(4, backbone.config.hidden_size, num_steps=args.steps, num_draws=args.draws,
                            time_dim=32, projector_dim=128)
    context = model.encode(backbone, ids, mask)
    targets = torch.softmax(3 * torch.randn(args.rows, 4, generator=torch.Generator().manual_seed(1)), -1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    rows = torch.arange(args.rows).repeat(32)
    for _ in range(300):
        loss = model.loss(context.select(rows), targets[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    decisions = targets.argmax(-1)
    variances = {}
    with torch.no_grad():
        for draws in ("common", "independent"):
            rewards = []
            for seed in range(args.seeds):
                generator = torch.Generator().manual_seed(seed)
                z0 = None if draws == "common" else torch.randn(*prefixes.shape, args.draws, 4, generator=generator)
                out = flow_sentence_rewards(model.flow, context, prefixes, prefix_mask, decisions, args.draws,
                                            args.steps, generator=generator, z0=z0)
                rewards.append(out.rewards[out.mask])
            variances[draws] = torch.stack(rewards).var(0).mean().item()
    ratio = variances["independent"] / variances["common"]
    print(f"sentence-reward variance over {args.seeds} z0 seeds (M={args.draws}): common {variances['common']:.3e}, "
          f"independent {variances['independent']:.3e}, independent/common {ratio:.2f}")
    for draws, variance in variances.items():
        append_csv(None, {"time": timestamp(), "benchmark": "sentence_reward_variance", "impl": draws, "size": "K=4",
                          "rows": args.rows, "draws": args.draws, "ode_steps": args.steps, "seeds": args.seeds,
                          "variance": variance, "ratio_vs_common": variance / variances["common"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--variance", action="store_true", help="measure the draw noise of the rewards instead")
    parser.add_argument("--seeds", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    backbone, tokenizer = load_backbone("bundled:explain_tiny/policy")
    backbone.eval().requires_grad_(False)
    if args.variance:
        reward_variance(args, backbone, tokenizer)
        return
    flow = ExplanationFlow(4, backbone.config.hidden_size, time_dim=32, projector_dim=128).eval()
    print(f"{'K':>3} {'tokens':>6} {'one-pass ms':>12} {'per-prefix ms':>14} {'ratio':>6}")
    for k in args.ks:
        ids, mask, prompt_lengths, ends = explanation_rows(tokenizer, args.rows, k)
        prefixes, _ = prefix_table(prompt_lengths, ends)
        z0 = torch.randn(*prefixes.shape, args.draws, 4)

        @torch.no_grad()
        def one_pass():
            return flow_samples(flow, encode_context(backbone, ids, mask), prefixes, z0, args.steps)

        @torch.no_grad()
        def per_prefix():
            return flow_samples_per_prefix(flow, backbone, ids, mask, prefixes, z0, args.steps)

        results = {"one_pass": measure(one_pass, warmup=1, reps=args.reps),
                   "per_prefix": measure(per_prefix, warmup=1, reps=args.reps)}
        ratio = results["per_prefix"]["median_ms"] / results["one_pass"]["median_ms"]
        print(f"{k:>3} {ids.shape[1]:>6} {results['one_pass']['median_ms']:>12.1f} "
              f"{results['per_prefix']['median_ms']:>14.1f} {ratio:>6.2f}")
        for path, stats in results.items():
            append_csv(None, {"time": timestamp(), "benchmark": "sentence_rewards", "impl": path, "size": f"K={k}",
                              "rows": args.rows, "draws": args.draws, "ode_steps": args.steps, **stats,
                              "ratio_vs_one_pass": ratio if path == "per_prefix" else 1.0})


if __name__ == "__main__":
    main()
