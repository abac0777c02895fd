"""Micro-batches by token budget (verl's ``use_dynamic_bsz`` + ``ppo_max_token_len_per_gpu``, OpenRLHF's
``max_tokens_per_gpu``): rows ordered longest first, packed into runs whose padded size stays under a budget (or,
for padding-free passes, whose real tokens do).

A micro-batch is padded to its longest row, so its cost (memory and compute) is rows × longest length. With the rows
sorted by length, consecutive rows have similar lengths and little is padded; a fixed number of rows per micro-batch
instead pads every short row to the longest one beside it, and must be small enough for the longest rows anywhere.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ReduceOp

from flowkit.distributed import all_reduce_int


def sequence_lengths(attention_mask: Tensor) -> Tensor:
    """B: each row's length up to its last real token (what :meth:`RolloutBatch.trimmed` keeps of it)."""
    positions = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device)
    return (attention_mask.bool() * positions).amax(-1).cpu()


def longest_first(lengths: Tensor) -> Tensor:
    """The row order by decreasing length, ties in row order (stable, so every rank and run orders alike)."""
    return torch.sort(lengths, descending=True, stable=True).indices


def pack_by_token_budget(lengths: Tensor, budget: int, max_rows: int | None = None,
                         count: int | None = None, padded: bool = True) -> list[slice]:
    """Micro-batches of consecutive rows, as runs ``slice(start, end)``; ``padded``: the rows sorted longest first
    (``lengths`` non-increasing), a run costing rows × its first (longest) row's length; else (padding-free passes)
    the sum of its rows' lengths, in any order.

    Greedy: a run takes the next row while its cost with it stays ≤ ``budget`` and, with ``max_rows``, rows + 1 ≤
    ``max_rows``; a row longer than the budget runs alone. With ``count`` (≤ the number of rows), the costliest run is
    then halved until there are ``count`` runs — how ranks that packed different numbers agree on the largest (each
    halving keeps every run under the budget).

    ``[7, 5, 5, 2, 2, 2]`` under 12 → ``[0:1], [1:3], [3:6]`` (7, 2 × 5 = 10, 3 × 2 = 6 tokens); with ``count`` 4
    the run of 10 tokens is halved: ``[0:1], [1:2], [2:3], [3:6]``. Not ``padded``: ``[0:2], [2:6]`` (12, 11).
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    values = lengths.tolist()
    if padded and any(a < b for a, b in zip(values, values[1:])):
        raise ValueError("pack_by_token_budget needs lengths sorted longest first")

    def cost(start: int, end: int) -> int:
        return (end - start) * values[start] if padded else sum(values[start:end])

    runs: list[slice] = []
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or cost(start, end + 1) > budget or (max_rows is not None and end - start >= max_rows):
            runs.append(slice(start, end))
            start = end
    if count is not None:
        if count > len(values):
            raise ValueError(f"cannot split {len(values)} rows into {count} micro-batches")
        while len(runs) < count:
            widest = max((i for i, run in enumerate(runs) if run.stop - run.start > 1),
                         key=lambda i: cost(runs[i].start, runs[i].stop))
            run = runs[widest]
            middle = (run.start + run.stop) // 2
            runs[widest:widest + 1] = [slice(run.start, middle), slice(middle, run.stop)]
    return runs


def padded_tokens(lengths: Tensor, runs: list[Tensor] | list[slice]) -> int:
    """Σ over micro-batches of rows × longest row: the positions the forward passes compute, padding included."""
    return sum(len(lengths[run]) * int(lengths[run].max()) for run in runs if len(lengths[run]))


def micro_batch_rows(attention_mask: Tensor, max_rows: int | None, budget: int | None,
                     keep: Tensor | None = None, padding_free: bool = False) -> list[Tensor | None]:
    """Row indices of each micro-batch of a batch, in order: ``max_rows`` rows each (None: all), or with a token
    ``budget`` (the rows come longest first) runs of rows packed under it (:func:`pack_by_token_budget`, at most
    ``max_rows`` rows when that is set too; a rank splits its runs until it has as many as the rank that packs the
    most, or one row each). ``padding_free``: the budget counts the rows' real tokens (the passes pack the rows
    without padding). With ``keep`` (a bool per row), only the kept rows.

    Multi-rank rule: every forward/backward is a collective under DDP and ZeRO, so every rank runs as many
    micro-batches as the rank with the most (at least one): a rank with fewer (fewer rows, kept or held) adds ``None``
    entries (padding micro-batches: one row through every module a real one reaches, zero loss). Counts are agreed
    (one all-reduce) before the first micro-batch runs."""
    rows = attention_mask.shape[0]
    index = torch.arange(rows) if keep is None else keep.cpu().nonzero().flatten()
    if budget is None:
        parts: list[Tensor | None] = list(index.split(max_rows or rows)) if len(index) else []
        return parts + [None] * (all_reduce_int(max(1, len(parts)), ReduceOp.MAX) - len(parts))
    lengths = (attention_mask.sum(-1).cpu() if padding_free else sequence_lengths(attention_mask))[index]
    padded = not padding_free
    count = all_reduce_int(max(1, len(pack_by_token_budget(lengths, budget, max_rows, padded=padded))), ReduceOp.MAX)
    runs = pack_by_token_budget(lengths, budget, max_rows, min(count, len(index)), padded)
    return [index[run] for run in runs] + [None] * (count - len(runs))
