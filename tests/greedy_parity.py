"""A callback for rehearsals with ``rollout_engine: vllm``: are vLLM's weights the trained policy's?

At the start and at the end of fit every rank completes the same few prompts greedily: at the start with HF
``generate`` over the initial policy, at the end with the module's vLLM engine and with HF ``generate`` over the
trained policy (under ZeRO-3 with the weights gathered for generation, as the HF rollout engine generates: a
collective, so every rank runs it, as here).
Each rank writes the three lists of completions to ``<default_root_dir>/greedy_parity/rank<r>.json`` for the test
to compare. Loaded by class path (``--trainer.callbacks+=greedy_parity.GreedyParity``): ``tests/`` is on the
rehearsal's ``PYTHONPATH``.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L

from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.strategies import whole_weights_for_generation

# Three prompts per rank, different on each rank, from the tiny adder's task.
PROMPTS = [["47+38=", "12+13=", "7+5="], ["55+21=", "9+9=", "63+27="]]


class GreedyParity(L.Callback):
    def __init__(self):
        self.initial: list[str] = []

    def _hf_greedy(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        engine = HFRolloutEngine(pl_module.policy, pl_module.tokenizer, pl_module.sampling.max_new_tokens,
                               whole_weights=lambda: whole_weights_for_generation(trainer, pl_module.policy))
        return engine.generate(PROMPTS[trainer.global_rank], 1, temperature=0).responses

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = self._hf_greedy(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        vllm = pl_module.rollout_engine.generate(PROMPTS[trainer.global_rank], 1, temperature=0).responses
        result = {"initial_hf": self.initial, "trained_vllm": vllm, "trained_hf": self._hf_greedy(trainer, pl_module),
                  "global_step": trainer.global_step}
        directory = Path(trainer.default_root_dir) / "greedy_parity"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, indent=1))
