"""2-rank ZeRO-3 job for tests/rl/test_lm_head_logprobs.py (run with ``torch.distributed.run``): counts the
all-gathers of the LM head over one micro-batch's forward and backward through lm_head_logprobs, whose ranks hold
different numbers of response tokens (several chunks each), and checks the log-probs and the head's gradient (the
ranks' mean, as ZeRO reduces it) against full logits. Rank 0 prints one line, ``RESULTS`` and the JSON list of every
rank's result (lines printed by each rank could interleave on the shared stdout)."""

import json
import sys

import deepspeed
import torch
import torch.distributed as dist

from flowkit.rl.logprobs import lm_head_logprobs, token_logprobs

D, VOCAB, CHUNK = 8, 300, 2
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
frozen = sys.argv[1] == "frozen"


class Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(D, D)  # 72 elements: stays whole (under the persistence threshold)
        self.head = torch.nn.Linear(D, VOCAB, bias=False).requires_grad_(not frozen)  # 2,400: sharded

    def forward(self, x, ids, mask):
        logprobs, _ = lm_head_logprobs(self.body(x), self.head, ids, mask, chunk_size=CHUNK)
        return logprobs.sum()


torch.manual_seed(0)
policy = Policy()
config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000}}
engine, *_ = deepspeed.initialize(model=policy, optimizer=torch.optim.SGD(policy.parameters(), lr=0.0),
                                  config=config)
rank, world = dist.get_rank(), dist.get_world_size()
generator = torch.Generator().manual_seed(rank)
x, ids = torch.randn(2, 9, D, generator=generator), torch.randint(0, VOCAB, (2, 9), generator=generator)


def response_mask(step: int) -> torch.Tensor:
    """As RL micro-batches do, ranks and steps differ in their response tokens: rank 0 has 16, 14, 12 (8, 7, 6
    chunks), rank 1 has 3 (2 chunks) — so a per-chunk head call would change ZeRO-3's module trace every step."""
    mask = torch.zeros(2, 9)
    if rank == 0:
        mask[:, 1:9 - step] = 1.0
    else:
        mask[1, 1:4] = 1.0
    return mask


GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced")
backend = deepspeed.comm.comm.cdb  # every ZeRO-3 all-gather (module hooks, GatheredParameters) goes through it
gathers = {"count": 0}


def counting(collective):
    def call(*args, **kwargs):
        gathers["count"] += 1
        return collective(*args, **kwargs)
    return call


counts = []
for step in range(3):  # the first step records ZeRO-3's module trace, the later ones fetch by it
    mask = response_mask(step)
    with deepspeed.zero.GatheredParameters([policy.head.weight]):
        head_weight = policy.head.weight.detach().clone()
    for name in GATHERS:
        setattr(backend, name, counting(getattr(backend, name)))
    gathers["count"] = 0
    loss = engine(x, ids, mask)
    engine.backward(loss)
    counts.append(gathers["count"])
    for name in GATHERS:
        delattr(backend, name)  # the class's methods again
    grad = None if frozen else deepspeed.utils.safe_get_full_grad(policy.head.weight).clone()
    engine.step()

weight = head_weight.requires_grad_(not frozen)
hidden = torch.nn.functional.linear(x, policy.body.weight.detach(), policy.body.bias.detach())
expected = (token_logprobs(torch.nn.functional.linear(hidden, weight), ids) * mask).sum()
result = {"rank": rank, "gathers": counts, "loss_close": bool(torch.allclose(loss.detach(), expected, atol=1e-4))}
if not frozen:
    (reference,) = torch.autograd.grad(expected, weight)
    dist.all_reduce(reference)
    result["head_grad_close"] = bool(torch.allclose(grad, reference / world, atol=1e-5))
results = [None] * world
dist.all_gather_object(results, result)
if rank == 0:
    print("RESULTS", json.dumps(results), flush=True)
dist.barrier()
dist.destroy_process_group()
