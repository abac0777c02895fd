"""2 ranks (gloo, CPU, plain weights) each make one step's rows as episodes of the bundled ``long_addition`` task with
the ``hf`` engine; rank 1's environment fails to start every episode. tests/agents/test_rank_faults.py runs it with
``torch.distributed.run``; each rank writes the error its ``EpisodeRollout.generate`` raised (or null) to
``OUT/rank{R}.json``, then meets the other at a barrier (a rank that went on alone would wait there)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch

from flowkit.agents import register_environment
from flowkit.agents.evaluate import EPISODE_TASKS
from flowkit.errors import RunError
from flowkit.llm.backbone import load_backbone
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.step.episodes import EpisodeRollout
from flowkit.step.experience import PromptBatch


@register_environment("rank_fault_job.unreachable")
class Unreachable:
    """An environment whose service never answers: every episode's ``reset`` fails."""

    tools = ()

    def reset(self, record):
        raise ConnectionError("the environment service refused the connection")

    def step(self, action):
        raise AssertionError("no episode gets past reset")


def main(out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    model, tokenizer = load_backbone("bundled:tiny_tool_adder")
    task = EPISODE_TASKS["long_addition"]
    options = task.options if rank == 0 else replace(task.options, environment="rank_fault_job.unreachable")
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=task.turn_tokens, temperature=0.0)
    records = task.records("test")[:2]
    prompts = PromptBatch([r["prompt"] for r in records], [r["answer"] for r in records],
                          {key: [r[key] for r in records] for key in records[0] if key not in ("prompt", "answer")})
    error = None
    try:
        EpisodeRollout(engine, tokenizer, options).generate(prompts, 1, torch.device("cpu"))
    except RunError as raised:
        error = str(raised)
    with open(f"{out}/rank{rank}.json", "w") as file:
        json.dump({"error": error}, file)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
