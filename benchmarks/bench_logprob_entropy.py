"""The LM head's softmax over the vocabulary for one chunk of tokens (flowkit.kernels.logprob_entropy), forward and
backward: the kernel this machine dispatches to (native C++ on CPU, Triton on CUDA) vs the PyTorch reference, in
one run.

    python benchmarks/bench_logprob_entropy.py [--rows 1024] [--vocab 32000,152064] [--reps 10] [--device cpu]

Each shape is float32 logits of ``--rows`` tokens × vocabulary (the mid race model's 32k, Qwen2's 152k) at
temperature 0.9: the forward (log p(target), entropy, log-normaliser) and the backward (the gradient written over a
copy of the logits, with an entropy term), timed per pass, the two implementations alternating rep by rep so
machine load hits both alike (on CPU one thread). Prints the median of each and the ratio kernel / reference (below
1: the kernel faster), and appends one row per shape and pass to benchmarks/results/results.csv.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_csv, timestamp

from flowkit.kernels import logprob_entropy as op


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_both(logits: torch.Tensor, targets: torch.Tensor, reps: int) -> dict[str, dict[str, float]]:
    """Median seconds of each pass and implementation, alternating the implementations rep by rep."""
    grads = torch.randn(2, len(targets), device=logits.device)
    buffer = torch.empty_like(logits)
    times = {name: {"forward": [], "backward": []} for name in ("kernel", "reference")}
    for rep in range(reps + 2):
        for name, passes in times.items():
            os.environ["FLOWKIT_KERNELS"] = "" if name == "kernel" else "reference"
            _synchronize(logits.device)
            start = time.perf_counter()
            _, entropy, log_normalizer = op.logprob_entropy(logits, targets, 0.9)
            _synchronize(logits.device)
            middle = time.perf_counter()
            buffer.copy_(logits)
            _synchronize(logits.device)
            copied = time.perf_counter()
            op.logprob_entropy_backward_(buffer, targets, log_normalizer, entropy, grads[0], grads[1], 0.9)
            _synchronize(logits.device)
            if rep >= 2:  # warm-up
                passes["forward"].append(middle - start)
                passes["backward"].append(time.perf_counter() - copied)
    os.environ.pop("FLOWKIT_KERNELS")
    return {name: {p: statistics.median(v) for p, v in passes.items()} for name, passes in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1024, help="tokens per chunk (update.lm_head_chunk_size)")
    parser.add_argument("--vocab", default="32000,152064")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--csv", default=None, help="results CSV (default benchmarks/results/results.csv)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    print(f"kernel: {op.backend_for(torch.empty(1, 1, device=device))} on {device.type}; torch {torch.__version__}")
    for vocab in (int(v) for v in args.vocab.split(",")):
        generator = torch.Generator().manual_seed(0)
        logits = (torch.randn(args.rows, vocab, generator=generator) * 3).to(device)
        targets = torch.randint(0, vocab, (args.rows,), generator=generator).to(device)
        medians = time_both(logits, targets, args.reps)
        for pass_name in ("forward", "backward"):
            kernel, reference = medians["kernel"][pass_name], medians["reference"][pass_name]
            print(f"{args.rows} x {vocab:>6} {pass_name:<8}: kernel {kernel * 1e3:8.1f} ms, reference "
                  f"{reference * 1e3:8.1f} ms, kernel / reference {kernel / reference:.3f}")
            append_csv(args.csv, {"bench": "logprob_entropy", "time": timestamp(), "device": device.type,
                                  "rows": args.rows, "vocab": vocab, "pass": pass_name, "kernel_s": kernel,
                                  "reference_s": reference, "ratio": kernel / reference})


if __name__ == "__main__":
    main()
