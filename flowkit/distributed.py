"""Agreeing on per-rank counts, so that collective work whose amount depends on a rank's data stays in step
(:func:`agreed_call_count`: the multi-rank rule of docs/design.md), gathering per-rank tensors of different sizes, and telling
DeepSpeed ZeRO-3's sharded parameters apart.

Plain torch (no Lightning), so every layer can use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import Tensor
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


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (a collective every rank calls); ``flag`` itself on one process."""
    return bool(all_reduce_int(int(flag), ReduceOp.MAX))


def zero3_sharded(params: Iterable[Tensor | None]) -> bool:
    """Whether any of ``params`` is a DeepSpeed ZeRO-3 partition (DeepSpeed marks those with ``ds_id``): its
    ``.data`` is empty until gathered, and every forward through it gathers it, a collective."""
    return any(hasattr(p, "ds_id") for p in params)


def gathered(params: list[Tensor]) -> contextlib.AbstractContextManager:
    """A context in which ``params`` are whole (read-only) when they are ZeRO-3 shards: DeepSpeed's
    ``GatheredParameters``, a collective (every rank must enter it as often); elsewhere nothing."""
    if zero3_sharded(params):
        import deepspeed  # sharded parameters mean DeepSpeed is installed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def agreed_call_count(count: int, module: torch.nn.Module) -> int:
    """How many times every rank calls ``module`` in a loop that makes ``count`` calls on this rank.

    Under ZeRO-3 with several ranks each call into a sharded module gathers its weights (in the forward, in a
    checkpoint's recomputation and in the backward): all ranks must make the same number of calls, or the
    collectives pair up wrongly (gloo aborts, NCCL hangs). A loop whose trip count depends on a rank's data (chunks
    of tokens, pieces of rows) therefore runs ``agreed_call_count(count, module)`` times, the extra calls on a dummy
    row whose result enters the loop's output scaled by 0 (so a backward through them runs too). Agree before the
    loop's first call (this is itself a collective; a rank still gathering weights would never reach it).
    Elsewhere this is ``count``: no rank waits for another.
    """
    multi_rank = torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if not (multi_rank and zero3_sharded(module.parameters())):
        return count
    return all_reduce_int(count, ReduceOp.MAX)


def all_gather_rows(tensor: Tensor) -> Tensor:
    """Every rank's ``tensor`` joined along dim 0 in rank order; ``tensor`` itself when no process group is
    initialised.

    Ranks may hold different numbers of rows (none included) and different sizes of the other dimensions: each
    is padded with zeros to the largest over the ranks (so the result holds the sum of the row counts and the
    largest of every other size). The dtype and the number of dimensions must agree.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensor
    if tensor.dtype == torch.bool:  # not every backend gathers bool
        return all_gather_rows(tensor.to(torch.uint8)).bool()
    device = tensor.device
    if torch.distributed.get_backend() == "nccl":
        tensor = tensor.cuda()
    world = torch.distributed.get_world_size()
    shape = torch.tensor(tensor.shape, dtype=torch.long, device=tensor.device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    torch.distributed.all_gather(shapes, shape)
    largest = torch.stack(shapes).amax(0).tolist()
    padded = tensor.new_zeros(largest)
    padded[tuple(slice(0, size) for size in tensor.shape)] = tensor
    gathered = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(gathered, padded)
    return torch.cat([rows[: int(size[0])] for rows, size in zip(gathered, shapes, strict=True)]).to(device)
