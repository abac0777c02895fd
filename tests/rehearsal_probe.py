"""Test helper callback for the paper rehearsals: proves that the ranks disagreed where the job must keep them in step.

Added through the CLI (``--trainer.callbacks+=rehearsal_probe.RehearsalProbe --trainer.callbacks.out DIR``, with
``tests/`` on PYTHONPATH). Before training it wraps the places where a rank's data sets how often a sharded module
is called — the flow-scoring chunks and the online flow-loss pieces — and records, per call, this rank's own count
and the count every rank then used; and every call into a Linear LM head (one per micro-batch, whatever its tokens:
``lm_head``), with the tokens it carried; and after each RL step the groups and rows this rank trained on
(``kept``: dynamic sampling keeps its own groups per rank), and in an agent run each episode's policy turns, tool
calls and tokens after the prompt (``episodes``: one list per step). At the end each rank writes ``probe_rank{R}.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L

import flowkit.rewards.flow.matching as matching
import flowkit.rl.logprobs as logprobs
from flowkit.rewards.flow.reward import FlowReward


class RehearsalProbe(L.Callback):
    def __init__(self, out: str):
        self.out = Path(out)
        self.records: dict[str, list] = {"lm_head": [], "flow_scoring": [], "flow_pieces": [], "kept": [],
                                         "episodes": []}

    def setup(self, trainer, pl_module, stage):
        matching.agreed_call_count = self._recording(matching.agreed_call_count, "flow_scoring")
        as_forward_of, head_calls = logprobs._as_forward_of, self.records["lm_head"]

        def recording_head(module, function, states):
            head_calls.append((len(states), 1))
            return as_forward_of(module, function, states)
        logprobs._as_forward_of = recording_head
        agree = FlowReward.agreed_over_ranks
        records = self.records["flow_pieces"]

        def recording_pieces(reward, pieces):
            agreed = agree(reward, pieces)
            records.append((len(pieces), len(agreed)))
            return agreed
        FlowReward.agreed_over_ranks = recording_pieces

    def _recording(self, agreed_call_count, site):
        records = self.records[site]

        def recording(count, module):
            agreed = agreed_call_count(count, module)
            records.append((count, agreed))
            return agreed
        return recording

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if outputs:  # a skipped step returns nothing
            rollouts = outputs["rollouts"]
            self.records["kept"].append((int(rollouts.group_ids.unique().numel()), rollouts.batch_size))
            if "episode" in rollouts.columns:
                self.records["episodes"].append([
                    (sum(turn["role"] == "policy" for turn in episode["turns"]), episode["counters"]["tool_calls"],
                     sum(turn["tokens"] for turn in episode["turns"])) for episode in rollouts.columns["episode"]])

    def on_train_end(self, trainer, pl_module):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"probe_rank{trainer.global_rank}.json").write_text(json.dumps(self.records))
