"""flowkit's kernels on and off on alternate steps of one RL run: the tiny job's step with every flowkit kernel against
``FLOWKIT_KERNELS=reference`` (``F.linear``, HF's forward at every decoding step, PyTorch's RMSNorm, SwiGLU, decoding
attention, rotary embedding and LM-head softmax, transformers' ``sdpa``), the two interleaved step by step in one
process.

    python benchmarks/bench_kernels_step.py [--steps 44] [--warmup 4] [--token-budget 1024] [--csv F]

The TRL race's ``flowkit-reference`` side runs the reference in a process of its own, minutes apart from flowkit's;
on a machine whose speed drifts by ±10% over minutes that difference drowns. Here step 2k runs flowkit's kernels and
step 2k+1 the reference (``FLOWKIT_KERNELS`` is read at every call), so both see the same machine, and the report is
the median of the paired ratios (step 2k over step 2k+1) after ``--warmup`` steps, beside each side's median. The
task is the race's tiny one (bundled tiny_adder, 16 prompts × 8 samples, 28 new tokens, the binary reward, one
thread); ``--token-budget`` is ``update.micro_batch_tokens`` (0: one micro-batch of all rows). The two sides train
one policy, so their rollouts differ only by the kernels' rounding.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import lightning as L
import torch

from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.modules.policy_options import OptimOptions, SamplingOptions, UpdateOptions

BENCHMARKS = str(Path(__file__).resolve().parent)


class AlternateKernels(L.Callback):
    """flowkit's kernels on even steps, ``FLOWKIT_KERNELS=reference`` on odd ones."""

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step % 2:
            os.environ["FLOWKIT_KERNELS"] = "reference"
        else:
            os.environ.pop("FLOWKIT_KERNELS", None)

    def on_train_end(self, trainer, *args):
        os.environ.pop("FLOWKIT_KERNELS", None)


def interleaved_times(steps: int, token_budget: int) -> list[float]:
    """Wall seconds of each of ``steps`` steps of the tiny job, kernels and reference in turn."""
    sys.path.insert(0, BENCHMARKS)
    from bench_rl_step import StepTimer

    torch.set_num_threads(1)
    L.seed_everything(0)
    module = PolicyModule(reward_model=None, outcome_reward="binary",
                          sampling=SamplingOptions(num_samples=8, max_new_tokens=28),
                          optim=OptimOptions(lr=5e-5, flow_lr=1e-3),
                          update=UpdateOptions(micro_batch_tokens=token_budget or None))
    timer = StepTimer("wall")
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[AlternateKernels(), timer])
    trainer.fit(module, datamodule=RolloutDataModule(val_path=None, batch_size=16))
    return timer.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=44)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out at the start (even)")
    parser.add_argument("--token-budget", type=int, default=1024, help="update.micro_batch_tokens; 0: none")
    parser.add_argument("--csv", default=None, help="CSV to append to (default benchmarks/results/results.csv)")
    args = parser.parse_args()
    if args.warmup % 2 or args.steps - args.warmup < 2:
        parser.error("--warmup must be even and leave at least one pair of steps")
    times = interleaved_times(args.steps, args.token_budget)[args.warmup:]
    kernels, reference = times[0::2], times[1::2]
    ratios = [a / b for a, b in zip(kernels, reference)]
    ratio = statistics.median(ratios)
    print(f"kernels median {statistics.median(kernels):.3f} s/step, reference {statistics.median(reference):.3f}; "
          f"paired ratio kernels / reference: median {ratio:.3f}, mean {statistics.mean(ratios):.3f} "
          f"({len(ratios)} pairs, token budget {args.token_budget})")
    sys.path.insert(0, BENCHMARKS)
    from common import append_csv, timestamp
    append_csv(args.csv, {"timestamp": timestamp(), "benchmark": "kernels_step", "implementation": "kernels/reference",
                          "device": "cpu", "size": f"tiny_adder 16x8, token budget {args.token_budget}",
                          "threads": 1, "ratio": ratio})


if __name__ == "__main__":
    main()
