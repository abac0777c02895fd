"""Micro-batches by token budget: packing by hand, padded tokens against fixed counts, and ranks agreeing on the
number of micro-batches (2 gloo processes)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowkit.batch import RolloutBatch
from flowkit.step import UpdateOptions
from flowkit.step.micro_batches import (
    longest_first, micro_batch_rows, pack_by_token_budget, padded_tokens, sequence_lengths,
)
from flowkit.errors import ConfigError


def runs(slices: list[slice]) -> list[tuple[int, int]]:
    return [(run.start, run.stop) for run in slices]


def test_packing_by_hand():
    lengths = torch.tensor([7, 5, 5, 2, 2, 2])
    # 7 alone (2 × 7 > 12), 2 × 5 = 10 (3 × 5 > 12), 3 × 2 = 6
    assert runs(pack_by_token_budget(lengths, 12)) == [(0, 1), (1, 3), (3, 6)]
    assert runs(pack_by_token_budget(lengths, 12, max_rows=2)) == [(0, 1), (1, 3), (3, 5), (5, 6)]
    assert runs(pack_by_token_budget(lengths, 5)) == [(0, 1), (1, 2), (2, 3), (3, 5), (5, 6)]  # 7 > 5 runs alone
    # count 4: the run holding the most padded tokens (2 × 5 = 10) is halved
    assert runs(pack_by_token_budget(lengths, 12, count=4)) == [(0, 1), (1, 2), (2, 3), (3, 6)]
    assert runs(pack_by_token_budget(lengths, 12, count=6)) == [(i, i + 1) for i in range(6)]
    assert pack_by_token_budget(torch.tensor([], dtype=torch.long), 12, count=0) == []
    with pytest.raises(ValueError, match="sorted"):
        pack_by_token_budget(torch.tensor([2, 5]), 12)
    with pytest.raises(ValueError, match="cannot split"):
        pack_by_token_budget(lengths, 12, count=7)


def test_lengths_and_order():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    assert sequence_lengths(mask).tolist() == [2, 4, 1, 3]
    assert longest_first(torch.tensor([2, 4, 2, 3])).tolist() == [1, 3, 0, 2]  # ties keep row order


def test_token_budget_pads_less_than_fixed_counts_on_long_tailed_lengths():
    """64 rows, lengths from a long tail (most 20-60 tokens, a few up to 400): 8 rows per micro-batch in generation
    order pad every short row to the longest beside it; the same number of forwards' worth of budget, sorted, does
    not. Hand check on 4 rows: [10, 100, 10, 10] in pairs → 2 × 100 + 2 × 10 = 220; sorted under 150 → 100 + 3 × 10."""
    four = torch.tensor([10, 100, 10, 10])
    assert padded_tokens(four, [torch.tensor([0, 1]), torch.tensor([2, 3])]) == 220
    ordered = four[longest_first(four)]
    assert padded_tokens(ordered, pack_by_token_budget(ordered, 150)) == 130
    generator = torch.Generator().manual_seed(0)
    lengths = (20 + torch.distributions.Exponential(1 / 30).sample((64,)).clamp(max=380)).long()
    fixed = padded_tokens(lengths, list(torch.arange(64).split(8)))
    ordered = lengths[longest_first(lengths)]
    budget = padded_tokens(ordered, pack_by_token_budget(ordered, 8 * int(lengths.max())))
    assert budget < 0.75 * fixed, (budget, fixed)
    assert budget >= int(lengths.sum())  # never less than the real tokens


def test_micro_batch_tokens_is_checked():
    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        UpdateOptions(micro_batch_tokens=0).check("PolicyModule")


def rank_batch(rank: int) -> RolloutBatch:
    """Rank 0: 6 rows of 9 tokens (6 micro-batches under 10 tokens); rank 1: 6 rows of 3 (2 micro-batches)."""
    length = 9 if rank == 0 else 3
    mask = torch.zeros(6, 10)
    mask[:, :length] = 1
    return RolloutBatch(input_ids=torch.zeros(6, 10, dtype=torch.long), attention_mask=mask, response_mask=mask,
                        group_ids=torch.arange(6))


def agreement_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    batch = rank_batch(rank)
    every = micro_batch_rows(batch.attention_mask, None, 10)
    keep = torch.tensor([True, False, False, False, False, False]) if rank == 1 else torch.ones(6, dtype=torch.bool)
    kept = micro_batch_rows(batch.attention_mask, None, 10, keep)
    results = {
        "every": [None if rows is None else rows.tolist() for rows in every],
        "kept": [None if rows is None else rows.tolist() for rows in kept],
        "tokens": [len(rows) * int(sequence_lengths(batch.attention_mask)[rows].max()) for rows in every],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_ranks_agree_on_the_number_of_micro_batches(tmp_path):
    """Rank 1 packs its short rows into 2 micro-batches, rank 0 needs 6: rank 1 splits its runs until it has 6 too
    (each still under the budget); with only the kept rows (rank 1 keeps one) rank 1 pads with None entries."""
    mp.spawn(agreement_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert len(rank0["every"]) == len(rank1["every"]) == 6
    assert sorted(row for rows in rank1["every"] for row in rows) == list(range(6))
    assert all(tokens <= 10 for tokens in rank0["tokens"] + rank1["tokens"])
    assert len(rank0["kept"]) == len(rank1["kept"]) == 6
    assert rank1["kept"] == [[0]] + [None] * 5
