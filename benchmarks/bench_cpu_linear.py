"""A float32 linear layer on CPU, forward and backward: flowkit's oneDNN route (flowkit.kernels.cpu_linear) vs
``F.linear`` (PyTorch's BLAS, MKL in the x86 wheels), one thread, in one run.

    python benchmarks/bench_cpu_linear.py [--reps 30] [--rows 16,64,128,1024]

Shapes: the linear layers of the bundled tiny policy (hidden 128, MLP 512, 2 KV heads of 32) and of the mid-size
race model (hidden 320, MLP 1600, 1 KV head of 64), each at ``--rows`` rows (tokens). Each shape is timed forward
only (decoding) and forward + backward with both gradients (training), the two implementations alternating rep by
rep so machine load hits both alike, the oneDNN side at every size. Prints the median time of each and the ratio
oneDNN / ``F.linear`` (below 1: oneDNN faster), with the product size in multiply-adds beside the threshold from
which flowkit takes oneDNN on this CPU (``ONEDNN_MIN_MACS``: 2^21 on Zen 5, 2^26 elsewhere), and appends one row
per shape and pass to benchmarks/results/results.csv.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_csv, timestamp

from flowkit.kernels import cpu_linear

SHAPES = {  # model: (in, out) of each distinct linear layer
    "tiny": [(128, 128), (128, 64), (128, 512), (512, 128)],
    "mid": [(320, 320), (320, 64), (320, 1600), (1600, 320)],
}


def one_pass(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, backward: bool) -> None:
    if not backward:
        with torch.no_grad():
            cpu_linear.linear(x, weight, bias)
        return
    cpu_linear.linear(x, weight, bias).sum().backward()


def time_both(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, backward: bool, reps: int) -> dict:
    """Median seconds per pass of each implementation, alternating them rep by rep; the oneDNN side takes oneDNN at
    every size (this CPU's threshold set aside), so the table shows where the two cross."""
    times: dict[str, list[float]] = {"onednn": [], "f_linear": []}
    threshold = cpu_linear.ONEDNN_MIN_MACS
    cpu_linear.ONEDNN_MIN_MACS = 0
    for rep in range(reps + 3):
        for name in times:
            os.environ["FLOWKIT_KERNELS"] = "" if name == "onednn" else "reference"
            start = time.perf_counter()
            one_pass(x, weight, bias, backward)
            if rep >= 3:  # warm-up
                times[name].append(time.perf_counter() - start)
    os.environ.pop("FLOWKIT_KERNELS")
    cpu_linear.ONEDNN_MIN_MACS = threshold
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rows", default="16,64,128,1024", help="comma-separated token counts")
    args = parser.parse_args()
    if cpu_linear._ONEDNN_LINEAR is None:
        raise SystemExit("this torch has no oneDNN: flowkit runs F.linear, nothing to compare")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}; flowkit takes oneDNN from "
          f"{cpu_linear.ONEDNN_MIN_MACS:,} multiply-adds")
    print(f"{'model':<5} {'in':>5} {'out':>5} {'rows':>5} {'MACs':>12}  {'pass':<9} {'F.linear':>10} "
          f"{'oneDNN':>10} {'ratio':>6}")
    for model, layers in SHAPES.items():
        for rows in (int(r) for r in args.rows.split(",")):
            for features_in, features_out in layers:
                x = torch.randn(rows, features_in, requires_grad=True)
                weight = torch.randn(features_out, features_in, requires_grad=True)
                bias = torch.randn(features_out, requires_grad=True)
                macs = rows * features_in * features_out
                for backward in (False, True):
                    median = time_both(x, weight, bias, backward, args.reps)
                    ratio = median["onednn"] / median["f_linear"]
                    label = "fwd+bwd" if backward else "forward"
                    print(f"{model:<5} {features_in:>5} {features_out:>5} {rows:>5} {macs:>12,}  {label:<9} "
                          f"{median['f_linear'] * 1e6:>8.1f}us {median['onednn'] * 1e6:>8.1f}us {ratio:>6.2f}")
                    append_csv(None, dict(benchmark="cpu_linear", implementation="onednn_vs_f_linear",
                                          device="cpu", dtype="float32", size=f"{model}:{features_in}x{features_out}",
                                          rows=rows, mode=label, median_ms=median["onednn"] * 1e3,
                                          value=ratio, threads=1, timestamp=timestamp()))


if __name__ == "__main__":
    main()
