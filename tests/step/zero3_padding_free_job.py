"""2-rank ZeRO-3 job for tests/step/test_padding_free.py (run with ``torch.distributed.run``): one RL step of the
bundled tiny policy — the scoring pass and the update, micro-batched under ``micro_batch_tokens`` — padded or
packed (``argv[1]``), the ranks holding 6 and 2 rows (so they pack different numbers of micro-batches and rank 1
runs padding ones). Each rank saves its scored log-probs, its step statistics and the updated weights (gathered) to
``argv[2]/<side>_rank<R>.pt``."""

import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from flowkit.batch import RolloutBatch
from flowkit.llm.backbone import load_backbone
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.step import (
    Actor, AdvantageOptions, ExperienceMaker, LossOptions, PolicyUpdate, PromptBatch, SamplingControls, UpdateOptions,
)

torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
side, out = sys.argv[1], Path(sys.argv[2])
rank = dist.get_rank()
PROMPTS, SAMPLES = ["3+4=", "68+62="], 4

model, tokenizer = load_backbone("bundled:tiny_adder", "float32", False)
torch.manual_seed(0)  # every rank samples the same 8 rows, then holds its own share
sampled = HFRolloutEngine(model, tokenizer, max_new_tokens=13, rollout_batch_size=8).generate(PROMPTS, SAMPLES)
held = sampled.select(list(range(6)) if rank == 0 else [6, 7])


class HeldRows:
    """The rollout engine: this rank's rows, as sampled above."""

    saw_nonfinite_logits, policy_version = False, 0

    def __init__(self, batch: RolloutBatch):
        self.batch, self.tokenizer = batch, tokenizer

    def generate(self, prompts, n=1, answers=None, temperature=None) -> RolloutBatch:
        return self.batch.select(list(range(self.batch.batch_size)))


def grade(batch: RolloutBatch) -> dict:
    batch.outcome_rewards = (torch.arange(batch.batch_size) % 2).float()  # rewards that differ within a group
    batch.correct = batch.outcome_rewards > 0
    return {}


class ZeroOptimizer:
    """The step's optimizer object over a DeepSpeed engine, as Lightning's manual optimization drives it."""

    def __init__(self, engine):
        self.engine = engine

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.optimizer.clear_backward_seen_flag()  # as flowkit.strategies.manual_backward
        self.engine.backward(loss)

    def nonfinite(self, groups) -> list[str]:
        return []

    def step(self, groups) -> None:
        self.engine.step()


config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config)
# two minibatches: a scoring pass runs (its log-probs are compared too) and each rank steps twice
update = UpdateOptions(micro_batch_tokens=48, lm_head_chunk_size=5, padding_free=side == "packed", num_minibatches=2)
actor = Actor(model, None, None, None, update, LossOptions())
maker = ExperienceMaker(actor, HeldRows(held), grade, None, AdvantageOptions(), update, SamplingControls(), SAMPLES)
experience = maker.make_experience(PromptBatch(PROMPTS, ["7", "130"]), step=0)
stats = PolicyUpdate(actor, update).train_on(experience, ZeroOptimizer(engine))
weights = {}
for name, param in model.named_parameters():
    with deepspeed.zero.GatheredParameters([param]):
        weights[name] = param.detach().clone()
order = torch.argsort(experience.sample_index)
torch.save({"old_logprobs": experience.old_logprobs[order] * experience.response_mask[order], "weights": weights,
            "stats": {key: float(value) for key, value in stats.items() if not key.startswith("time/")}},
           out / f"{side}_rank{rank}.pt")
# every rank leaves the group together: a rank exiting with gloo's threads still live aborts under load
dist.barrier()
dist.destroy_process_group()
