"""The multi-rank rule on 2 gloo processes: loops over a ZeRO-3-sharded module make as many calls on every rank,
however much data each rank holds, and the padding calls change no result.

DeepSpeed marks a ZeRO-3 partition with ``ds_id``; here the modules' parameters carry that mark, and a forward
pre-hook counts the calls (forward passes and a checkpoint's recomputations in the backward), which is what
DeepSpeed turns into parameter all-gathers.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowkit.batch import RolloutBatch
from flowkit.distributed import agreed_call_count
from flowkit.rewards.flow import VelocityField, velocity_deviation_scores
from flow_options import flow_reward
from flowkit.rl.logprobs import lm_head_logprobs
from backbone_stub import backbone_stub

D, VOCAB = 8, 11


def counted(module: torch.nn.Module, counts: dict[str, int], name: str) -> torch.nn.Module:
    """Mark ``module``'s parameters as ZeRO-3 shards; each call into it counts and, as DeepSpeed's gather does, runs
    a collective (a rank out of step fails on the process group's timeout instead of passing)."""
    for p in module.parameters():
        p.ds_id = 0
    counts[name] = 0

    def hook(*_):
        counts[name] += 1
        dist.all_reduce(torch.ones(1))
    module.register_forward_pre_hook(hook)
    return module


def rank_data(rank: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0 holds long responses, rank 1 short ones (one row without any response token)."""
    lengths = [9, 7, 8] if rank == 0 else [2, 0, 1]
    mask = torch.zeros(3, 11)
    for row, length in enumerate(lengths):
        mask[row, 1:1 + length] = 1.0
    return torch.randn(2, 3, 11, D, generator=generator), mask


def worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(10 + rank)
    counts: dict[str, int] = {}
    results = {}

    head = counted(torch.nn.Linear(D, VOCAB), counts, "head")
    latents, mask = rank_data(rank, generator)
    hidden = torch.randn(3, 11, D, generator=generator, requires_grad=True)
    ids = torch.randint(0, VOCAB, (3, 11), generator=generator)
    logprobs, _ = lm_head_logprobs(hidden, head, ids, mask, chunk_size=3)
    logprobs.sum().backward()  # each checkpointed chunk recomputes its head call
    with torch.no_grad():  # the same values without any padding call
        logits = torch.nn.functional.linear(hidden[:, :-1], head.weight, head.bias)
        reference = torch.nn.functional.pad(torch.log_softmax(logits, -1)
                                            .gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0)) * mask.bool()
    results["logprobs_equal"] = bool(torch.allclose(logprobs.detach(), reference, atol=1e-6))

    field = counted(VelocityField(D, depth=1), counts, "scoring field")
    scores = velocity_deviation_scores(field, latents, mask, [0.25, 0.5], [0.8], seed=3, condition="previous",
                                       max_rows=4)
    alone = VelocityField(D, depth=1)
    alone.load_state_dict(field.state_dict())
    results["scores_equal"] = bool(torch.equal(scores, velocity_deviation_scores(
        alone, latents, mask, [0.25, 0.5], [0.8], seed=3, condition="previous", max_rows=4)))

    reward = flow_reward(percentiles=(0.25, 0.5), depth=1, seed=5, kappa=1, max_rows_per_piece=6)
    reward.bind(backbone_stub(D), [0.25, 0.5])
    counted(reward.field, counts, "update field")
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones(3, 11), response_mask=mask,
                         group_ids=torch.arange(3))
    batch.latents, batch.correct, batch.entropy = latents, torch.ones(3, dtype=torch.bool), torch.rand(3)
    scorer = reward.begin_step(0, batch)
    scorer.score(batch, torch.arange(3))
    pieces = scorer.end_step(batch)
    results["pieces"] = len(pieces)
    counts["update field"] = 0
    for piece in pieces:
        piece().backward()
    results["update_grads"] = all(p.grad is not None for p in reward.field.parameters())
    results["calls"] = counts
    results["agreed"] = agreed_call_count(rank + 1, head)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_sharded_loops_call_equally_often_on_every_rank(tmp_path):
    mp.spawn(worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0["calls"] == rank1["calls"], (rank0["calls"], rank1["calls"])
    # a Linear head is called once per micro-batch (all 24 response tokens of rank 0, in chunks of 3, inside that
    # call); 24 / 2 field calls
    assert rank0["calls"]["head"] == 1 and rank0["calls"]["scoring field"] == 12
    assert rank0["pieces"] == rank1["pieces"] == rank0["calls"]["update field"] > 1
    for results in (rank0, rank1):
        assert results["logprobs_equal"] and results["scores_equal"] and results["update_grads"]
        assert results["agreed"] == 2
