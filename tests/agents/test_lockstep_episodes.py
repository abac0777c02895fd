"""Episodes on ranks whose weights are ZeRO-3 shards (each ``hf`` generation a collective: the weights gathered whole
once, or in every decoding step): ranks whose episodes take different numbers of turns make the same number of ``generate`` calls, the rank that is
done calling with no prompts, and every rank's episodes come out as one process with whole weights plays them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import zero3_episodes_job as job

from flowkit.agents import EpisodeRunner, engine_generate
from flowkit.agents.evaluate import EPISODE_TASKS
from flowkit.llm.backbone import load_backbone
from flowkit.llm.hf_engine import HFRolloutEngine

pytestmark = pytest.mark.slow


def played_alone(rank: int) -> list[list[int]]:
    """Rank ``rank``'s episodes in one process with whole weights."""
    model, tokenizer = load_backbone("bundled:tiny_tool_adder")
    task = EPISODE_TASKS["long_addition"]
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=task.turn_tokens, temperature=0.0)
    runner = EpisodeRunner(engine_generate(engine), tokenizer, replace(task.options, max_turns=job.MAX_TURNS[rank]))
    return [list(t.token_ids) for t in runner.run(task.records("test")[rank * job.RECORDS:(rank + 1) * job.RECORDS])]


def test_zero3_ranks_with_episodes_of_different_turns_generate_in_lockstep(tmp_path, single_thread):
    pytest.importorskip("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(job.__file__).parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             job.__file__, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]

    assert len(ranks[0]["calls"]) == len(ranks[1]["calls"])  # one collective decode per call, on both ranks
    real = [sum(1 for prompts in rank["calls"] if prompts) for rank in ranks]
    assert real[1] > real[0], real  # rank 0 was done after its first turn and kept stepping for rank 1
    assert ranks[0]["calls"][real[0]:] == [0] * (len(ranks[0]["calls"]) - real[0])
    for rank, played in enumerate(ranks):
        assert played["token_ids"] == played_alone(rank), f"rank {rank}"
    turns = [sum(1 for start, now in zip([0, *mask], mask) if now and not start) for mask in ranks[1]["loss_masks"]]
    assert max(turns) > 1, turns  # rank 1's episodes did take several policy turns
