"""Agreeing on per-rank counts, so that collective work whose amount depends on a rank's data stays in step.

Plain torch (no Lightning), so every layer can use it.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp


def all_reduce_int(value: int, op: ReduceOp.RedOpType) -> int:
    """``value`` reduced over all ranks by ``op``; ``value`` itself when no process group is initialised."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    reduced = torch.tensor(value, dtype=torch.long)
    if torch.distributed.get_backend() == "nccl":
        reduced = reduced.cuda()
    torch.distributed.all_reduce(reduced, op=op)
    return int(reduced)
