"""2 ranks under DeepSpeed ZeRO-3 (gloo, CPU) play agent episodes greedily with the ``hf`` engine, whose every decoding
step gathers the sharded weights (a collective; the trainer gathers them once per generation instead, also a
collective): rank 0's episodes stop after one turn, rank 1's run to four, so the ranks need different numbers of
``generate`` calls. tests/agents/test_lockstep_episodes.py runs it with ``torch.distributed.run``; each rank writes
its trajectories' token ids and its calls to ``OUT/rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import deepspeed
import torch

from flowkit.agents import EpisodeRunner, engine_generate
from flowkit.agents.evaluate import EPISODE_TASKS
from flowkit.distributed import any_rank
from flowkit.llm.backbone import load_backbone
from flowkit.llm.hf_engine import HFRolloutEngine

MAX_TURNS = (1, 4)  # rank 0's, rank 1's
RECORDS = 3


def main(out: str) -> None:
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    model, tokenizer = load_backbone("bundled:tiny_tool_adder")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    task = EPISODE_TASKS["long_addition"]
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=task.turn_tokens, temperature=0.0)
    assert engine.lockstep, "the weights are not sharded: the job no longer sets up what it tests"
    generate, calls = engine_generate(engine), []

    def counted(prompts, max_new_tokens):
        calls.append(len(prompts))
        return generate(prompts, max_new_tokens)

    options = replace(task.options, max_turns=MAX_TURNS[rank])
    records = task.records("test")[rank * RECORDS:(rank + 1) * RECORDS]
    trajectories = EpisodeRunner(counted, tokenizer, options).run(records, lockstep=any_rank)
    with open(f"{out}/rank{rank}.json", "w") as file:
        json.dump({"calls": calls, "token_ids": [list(t.token_ids) for t in trajectories],
                   "loss_masks": [list(t.loss_mask) for t in trajectories]}, file)
    torch.distributed.barrier()  # leave together: a rank exiting with gloo's threads live aborts under load
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
