"""Success of a policy at a bundled episode task, as RL samples it: ``flowkit.agents.evaluate.episode_success``.

Run from the repository root (deterministic for a seed, one thread)::

    python scripts/eval_episodes.py --model bundled:tiny_tool_adder --environment long_addition
    python scripts/eval_episodes.py --model export/policy --environment guess_number --samples 8

``--model``: a model directory (``flowkit export`` writes the trained policy's to ``<out>/policy``) or
``bundled:NAME``. Plays ``--samples`` episodes per record of the first ``--records`` records of ``--split``
through the episode runner and the ``hf`` engine at ``--temperature`` (0: greedy; the defaults are the model cards'
measurement) and prints the episode metrics as JSON:
``episodes/success_rate`` (pass@1), ``episodes/pass@<samples>``, turns per episode, tool-call error rate, ...
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from flowkit.agents.evaluate import EPISODE_TASKS, episode_success
from flowkit.llm.backbone import load_backbone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory or bundled:NAME")
    parser.add_argument("--environment", required=True, choices=sorted(EPISODE_TASKS))
    parser.add_argument("--split", default="test", choices=("train", "val", "test"))
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--samples", type=int, default=4, help="episodes per record")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, tokenizer = load_backbone(args.model)
    task = EPISODE_TASKS[args.environment]
    metrics = episode_success(model, tokenizer, task, task.records(args.split)[:args.records], args.samples,
                              args.temperature, args.seed)
    print(json.dumps({"model": args.model, "environment": args.environment, "split": args.split,
                      "records": args.records, "samples": args.samples, "temperature": args.temperature,
                      "seed": args.seed, **metrics}, indent=1))


if __name__ == "__main__":
    main()
