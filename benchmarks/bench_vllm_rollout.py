"""Rollout generation time of the tiny job: HF ``generate`` vs the colocated vLLM engine, measured in one run.

    python benchmarks/bench_vllm_rollout.py [--reps 6] [--warmup 2]

Needs vLLM (the CPU venv of .ci/run: ``build/vllm_venv``). Both engines sample the same 16 prompts × 8 samples,
28 new tokens, temperature 1 (configs/rlfr_tiny.yaml) from the same bundled tiny_adder weights, in one process
with one torch thread; the engines alternate call by call (hf, vllm, hf, ...) so a busy machine slows both alike.
Prints median / p20 / p80 ms per engine and the ratio of medians, and appends rows to
benchmarks/results/results.csv.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402

from flowkit.llm.backbone import load_backbone, resolve_backbone_path  # noqa: E402
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.vllm_engine import VllmRolloutEngine  # noqa: E402
from flowkit.modules import RolloutDataModule  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy, tokenizer = load_backbone("bundled:tiny_adder")
    engines = {"hf": HFRolloutEngine(policy, tokenizer, max_new_tokens=28),
               "vllm": VllmRolloutEngine(policy, tokenizer, resolve_backbone_path("bundled:tiny_adder"), max_new_tokens=28)}
    data = RolloutDataModule(batch_size=16, val_path=None)
    data.setup("fit")
    stream = iter(data.train_dataloader())
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(args.warmup + args.reps):
        prompts = next(stream)
        for name, engine in engines.items():
            start = time.perf_counter()
            batch = engine.generate(prompts["prompt"], 8, prompts["answer"])
            elapsed = time.perf_counter() - start
            if rep >= args.warmup:
                times[name].append(elapsed * 1e3)
                tokens[name].append(float(batch.response_mask.sum()))
    from common import append_csv, timestamp

    medians = {}
    for name, values in times.items():
        q = statistics.quantiles(values, n=10, method="inclusive")
        medians[name] = statistics.median(values)
        print(f"{name:5s} median {medians[name]:8.1f} ms  p20 {q[1]:8.1f}  p80 {q[7]:8.1f}  "
              f"mean response tokens {statistics.mean(tokens[name]) / 128:.1f}")
        append_csv(args.csv, {"timestamp": timestamp(), "benchmark": "rollout_generate", "implementation": name,
                              "device": "cpu", "dtype": "float32", "size": "16x8x28", "median_ms": medians[name],
                              "p20_ms": q[1], "p80_ms": q[7], "threads": 1})
    print(f"vllm / hf generation time: {medians['vllm'] / medians['hf']:.3f}")


if __name__ == "__main__":
    main()
