"""Micro-batches by token budget vs a fixed number of rows, at a long-tailed response-length distribution.

    python benchmarks/bench_token_budget.py [--rows 64] [--max-length 512] [--rows-per-micro-batch 8]

A step's rows have lengths drawn from a log-normal (median ``--median`` tokens, a tail to ``--max-length``: at
paper scale responses run from a few dozen to 3,072 tokens). Both arms compute the same loss — the token-mean NLL of
every row, each micro-batch contributing its share, as :class:`flowkit.step.RLStep` does — with a forward and
backward of a random Qwen2 per micro-batch, padded to its longest row:

- ``fixed``: ``--rows-per-micro-batch`` rows per micro-batch in generation order (flowkit's ``micro_batch_size``),
  which must be small enough for the longest rows anywhere: its peak is rows × ``--max-length`` tokens;
- ``token_budget``: rows longest first, packed under a budget of that same peak (flowkit's ``micro_batch_tokens``,
  :func:`flowkit.step.micro_batches.pack_by_token_budget`): the same memory bound, fewer padded positions.

Reports, per arm, the micro-batches, the padded positions computed (rows × longest row, summed) and the median step
time over ``--reps``, and the ratios token_budget / fixed, measured in one run and appended to the results CSV.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from flowkit.step.micro_batches import longest_first, pack_by_token_budget, padded_tokens
from flowkit.llm.tiny import tiny_qwen2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_csv, measure, timestamp  # noqa: E402


def long_tailed_lengths(rows: int, median: int, max_length: int, seed: int) -> torch.Tensor:
    """Log-normal lengths (σ = 1) around ``median``, clipped to [8, ``max_length``], with at least one row at the
    maximum (a step holds its longest rollout)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = (median * torch.exp(torch.randn(rows, generator=generator))).round().clamp(8, max_length).long()
    lengths[int(torch.randint(rows, (1,), generator=generator))] = max_length
    return lengths


def step(model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor, runs: list[torch.Tensor]) -> None:
    """One update's forward and backward over ``runs`` (row indices per micro-batch), each padded to its longest
    row; the token-mean NLL over all rows, each micro-batch adding its share."""
    total = int(lengths.sum())
    for run in runs:
        width = int(lengths[run].max())
        tokens = ids[run, :width]
        mask = (torch.arange(width)[None] < lengths[run, None]).float()
        logits = model(input_ids=tokens, attention_mask=mask.long()).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        ((nll * mask[:, 1:]).sum() / total).backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="rows (rollouts) per update")
    parser.add_argument("--median", type=int, default=64, help="median response length")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--rows-per-micro-batch", type=int, default=8, help="the fixed arm's micro_batch_size")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = tiny_qwen2(vocab_size=1024, hidden_size=args.hidden, num_layers=args.layers,
                       intermediate_size=4 * args.hidden, max_positions=args.max_length)
    lengths = long_tailed_lengths(args.rows, args.median, args.max_length, args.seed)
    ids = torch.randint(3, 1024, (args.rows, args.max_length))
    budget = args.rows_per_micro_batch * args.max_length
    order = longest_first(lengths)
    arms = {
        "fixed": list(torch.arange(args.rows).split(args.rows_per_micro_batch)),
        "token_budget": [order[run] for run in pack_by_token_budget(lengths[order], budget)],
    }
    print(f"{args.rows} rows, lengths median {int(lengths.median())}, mean {lengths.float().mean():.0f}, max "
          f"{int(lengths.max())} ({int(lengths.sum())} real tokens); peak per micro-batch {budget} tokens in both arms")
    results = {}
    for name, runs in arms.items():
        padded = padded_tokens(lengths, runs)
        timing = measure(lambda runs=runs: step(model, ids, lengths, runs), warmup=1, reps=args.reps)
        results[name] = (len(runs), padded, timing["median_ms"] / 1e3)
        print(f"{name:13s} {len(runs):3d} micro-batches, {padded:7d} padded positions "
              f"({padded / int(lengths.sum()):.2f}x the real tokens), step {timing['median_ms'] / 1e3:.3f} s")
    (fixed_count, fixed_padded, fixed_s), (count, padded, seconds) = results["fixed"], results["token_budget"]
    print(f"token_budget / fixed: padded positions {padded / fixed_padded:.2f}x, step time {seconds / fixed_s:.2f}x")
    for name, (micro_batches, positions, median_s) in results.items():
        append_csv(args.csv, {
            "timestamp": timestamp(), "benchmark": "token_budget", "implementation": name, "device": "cpu",
            "dtype": "float32", "threads": torch.get_num_threads(),
            "size": f"{args.rows} rows, median {args.median}, max {args.max_length}, h{args.hidden} l{args.layers}",
            "micro_batches": micro_batches, "padded_positions": positions, "median_s": round(median_s, 4),
            "ratio_to_fixed": round(median_s / fixed_s, 3),
        })


if __name__ == "__main__":
    main()
