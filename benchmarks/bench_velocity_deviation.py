"""Benchmark the RLFR velocity-deviation prologue + epilogue, and the whole reward path, per implementation.

Part 1 ("fused"): everything except the velocity network — x_t for all (percentile, timestep) pairs and the
debiased deviation (RLFR eqs. 5, 7) — with an identity velocity (v = x_t) so only the kernels are timed.
Implementations: ``naive`` (per-layer, per-timestep loop materialising ε and targets, as the official RLFR code
does), ``naive_compiled`` (torch.compile of that loop), and flowkit's scoring path
(``flowkit.kernels.velocity_deviation_in_chunks``: stacked rows in chunks of at most ``--max-rows``, 0 = one
call) on the ``reference`` (PyTorch), ``native`` (flowkit._C: C++ on CPU, CUDA on GPU) and ``triton`` (CUDA)
backends.

Part 2 ("reward_path"): the same with a depth-4, width-d velocity network, batched through the fused ops vs the
naive per-(p, t) loop; ``--train`` also times forward + backward of the flow loss (eq. 4), which flowkit runs as
one stacked call (chunks would not bound the memory autograd keeps).

Usage: python benchmarks/bench_velocity_deviation.py [--device cpu] [--sizes 8192x1536] [--path-sizes 1024x512]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_csv, measure, timestamp

from flowkit.rewards.flow.matching import DEFAULT_MAX_ROWS
from flowkit.kernels import debias_weights, interpolate_latents, velocity_deviation, velocity_deviation_in_chunks
from flowkit.kernels.reference import velocity_deviation as reference

SEED = 1234


def naive_loop(x1, timesteps: list[float], weights: list[float], mask, velocity=None):
    """Per-(p, t) loop with ε and the target materialised (official RLFR style); identity velocity by default."""
    layers, tokens, _ = x1.shape
    score = torch.zeros(tokens, device=x1.device)
    for p in range(layers):
        for t, w in zip(timesteps, weights):
            eps = torch.randn_like(x1[p])
            x_t = t * x1[p] + (1 - t) * eps
            target = x1[p] - eps
            v = x_t if velocity is None else velocity(x_t, t, p / layers)
            score += w * ((v - target) ** 2).mean(-1)
    return score / (layers * len(timesteps)) * mask


def fused(x1, timesteps, weights, mask, max_rows: int | None, velocity=None):
    """flowkit's path: stacked x_t chunks → (velocity network) → deviation, on the backend FLOWKIT_KERNELS names."""
    layers = x1.shape[0]

    def velocity_rows(x_t, tokens: slice):
        if velocity is None:
            return x_t
        count = tokens.stop - tokens.start
        t_rows = timesteps.repeat_interleave(count).repeat(layers)
        layer_rows = (torch.arange(layers, device=x1.device) / layers).repeat_interleave(len(timesteps) * count)
        return velocity(x_t, t_rows, layer_rows)

    return velocity_deviation_in_chunks(velocity_rows, x1, timesteps, weights, SEED, mask, max_rows)


def velocity_network(dim: int, depth: int, device):
    """flowkit's VelocityField (RLFR §3.2) when present, else a token-wise MLP of the same depth and width."""
    try:
        from flowkit.rewards.flow.field import VelocityField

        net = VelocityField(dim, depth=depth, conditioned=False).to(device)

        def call(x_t, t, layer):
            rows = x_t.shape[0]
            t = torch.as_tensor(t, device=device, dtype=x_t.dtype).expand(rows)
            layer = torch.as_tensor(layer, device=device, dtype=x_t.dtype).expand(rows)
            return net(x_t, t, layer)

        return net, call, "VelocityField"
    except (ImportError, TypeError):
        layers = [nn.Linear(dim, dim)]
        for _ in range(depth - 1):
            layers += [nn.SiLU(), nn.Linear(dim, dim)]
        net = nn.Sequential(*layers).to(device)
        return net, (lambda x_t, t, layer: net(x_t)), "mlp"


def inputs(layers, steps, tokens, dim, device):
    x1 = torch.randn(layers, tokens, dim, device=device)
    timesteps = torch.linspace(0.5, 0.8, steps, device=device) if steps > 1 else torch.tensor([0.8], device=device)
    mask = (torch.rand(tokens, device=device) > 0.1).float()
    return x1, timesteps, debias_weights(timesteps), mask


def implementations(device: str, wanted: str | None) -> list[str]:
    """The requested implementations (default all) that run on ``device``."""
    from flowkit.kernels import available_backends

    available = available_backends(device)
    found = ["naive", "naive_compiled", "reference"]
    found += [b for b in ("native", "triton") if b in available and (b != "triton" or device == "cuda")]
    return [impl for impl in found if wanted is None or impl in wanted.split(",")]


def run_case(name, impl, fn, size, device, reps, warmup, bytes_moved, csv_path, extra=None):
    os.environ["FLOWKIT_KERNELS"] = impl if impl in ("native", "triton") else "reference"
    stats = measure(fn, warmup=warmup, reps=reps, device=device)
    row = dict(benchmark=name, implementation=impl, device=device, dtype="float32", size=size, **stats,
               gbps=bytes_moved / stats["median_ms"] / 1e6, timestamp=timestamp(), **(extra or {}))
    append_csv(csv_path, row)
    mem = "n/a" if stats["peak_mem_mb"] is None else f"{stats['peak_mem_mb']:.0f}"
    print(f"{name:14s} {impl:15s} {size:22s} median {stats['median_ms']:9.2f} ms "
          f"(p20 {stats['p20_ms']:.2f}, p80 {stats['p80_ms']:.2f})  {row['gbps']:6.1f} GB/s  peak +{mem} MB", flush=True)
    return stats


def copy_bandwidth_gbps(device: str, numel: int = 1 << 28) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time), the roofline for the epilogue."""
    src = torch.empty(numel, device=device)
    dst = torch.empty_like(src)
    stats = measure(lambda: dst.copy_(src), warmup=2, reps=10, device=device)
    return 2 * 4 * numel / stats["median_ms"] / 1e6


def report_ratios(title, results, baseline_names, target="native"):
    if target not in results:
        return
    for base in baseline_names:
        if base in results:
            time_ratio = results[base]["median_ms"] / results[target]["median_ms"]
            mem_base, mem_target = results[base]["peak_mem_mb"], results[target]["peak_mem_mb"]
            mem = f", peak-memory ratio {target}/{base} = {mem_target / mem_base:.3f}" if mem_base and mem_target else ""
            print(f"  {title}: {target} is {time_ratio:.2f}x faster than {base}{mem}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sizes", default="8192x1536", help="comma-separated NxD for the fused ops")
    parser.add_argument("--path-sizes", default="1024x512", help="comma-separated NxD for the whole reward path")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--max-rows", type=int, default=DEFAULT_MAX_ROWS,
                        help="stacked rows per velocity call when scoring (flowkit's default; 0 = one call)")
    parser.add_argument("--train", action="store_true", help="also time forward+backward of the flow loss")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--impls", default=None,
                        help="comma-separated subset of naive,naive_compiled,reference,native,triton (default: all)")
    parser.add_argument("--epilogue", action="store_true", help="also time the epilogue alone vs copy bandwidth")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, P, T = args.device, args.layers, args.steps
    max_rows = args.max_rows or None
    chunking = dict(max_rows=args.max_rows)
    impls = implementations(device, args.impls)
    compiled_loop = torch.compile(naive_loop) if "naive_compiled" in impls else None

    for size in filter(None, args.sizes.split(",")):
        N, D = map(int, size.split("x"))
        x1, ts, w, mask = inputs(P, T, N, D, device)
        ts_list, w_list = ts.tolist(), w.tolist()
        bytes_moved = 4 * (2 * P * N * D + 2 * P * T * N * D)  # read x1 twice, write x_t, read v
        label = f"P{P}T{T}N{N}d{D}"
        results = {}
        for impl in impls:
            if impl == "naive":
                fn = lambda: naive_loop(x1, ts_list, w_list, mask)
            elif impl == "naive_compiled":
                fn = lambda: compiled_loop(x1, ts_list, w_list, mask)
            else:
                fn = lambda: fused(x1, ts, w, mask, max_rows)
            with torch.no_grad():
                results[impl] = run_case("fused_ops", impl, fn, label, device, args.reps, args.warmup, bytes_moved,
                                         args.csv, extra=None if impl.startswith("naive") else chunking)
        report_ratios("prologue+epilogue", results, ["naive", "naive_compiled", "reference"])
        report_ratios("prologue+epilogue", results, ["naive", "naive_compiled", "reference"], target="triton")
        if args.epilogue:
            v = interpolate_latents(x1, ts, SEED)
            epilogue_bytes = 4 * (P * N * D + P * T * N * D)  # read x1 and v once
            copy = copy_bandwidth_gbps(device)
            append_csv(args.csv, dict(benchmark="epilogue", implementation="copy", device=device, dtype="float32",
                                      size=label, gbps=copy, timestamp=timestamp()))
            print(f"device-to-device copy: {copy:.1f} GB/s")
            for impl in [i for i in impls if i in ("reference", "native", "triton")]:
                fn = lambda impl=impl: (reference.velocity_deviation if impl == "reference" else velocity_deviation)(
                    v, x1, ts, w, SEED, mask)
                with torch.no_grad():
                    stats = run_case("epilogue", impl, fn, label, device, args.reps, args.warmup, epilogue_bytes, args.csv)
                print(f"  epilogue {impl}: {epilogue_bytes / stats['median_ms'] / 1e6 / copy:.1%} of copy bandwidth")

    for size in filter(None, args.path_sizes.split(",")):
        N, D = map(int, size.split("x"))
        x1, ts, w, mask = inputs(P, T, N, D, device)
        ts_list, w_list = ts.tolist(), w.tolist()
        net, call, net_name = velocity_network(D, args.depth, device)
        label = f"P{P}T{T}N{N}d{D}"
        bytes_moved = 4 * (2 * P * N * D + 2 * P * T * N * D)
        path_impls = ["naive"] + [i for i in impls if i in ("native", "triton")]
        for mode in ["reward"] + (["train"] if args.train else []):
            results = {}
            for impl in path_impls:
                if impl == "naive":
                    def fn():
                        return naive_loop(x1, ts_list, w_list, mask, velocity=call)
                else:
                    def fn(rows=max_rows if mode == "reward" else None):
                        return fused(x1, ts, w, mask, rows, velocity=call)
                extra = dict(network=net_name, mode=mode)
                if impl != "naive":
                    extra["max_rows"] = args.max_rows if mode == "reward" else 0
                if mode == "reward":
                    with torch.no_grad():
                        stats = run_case("reward_path", impl, fn, label, device, args.reps, args.warmup, bytes_moved,
                                         args.csv, extra=extra)
                else:
                    def step(fn=fn):
                        net.zero_grad(set_to_none=True)
                        fn().sum().backward()
                    stats = run_case("reward_path", impl, step, label, device, args.reps, args.warmup, bytes_moved,
                                     args.csv, extra=extra)
                results[impl] = stats
            report_ratios(f"whole path ({mode}, {net_name})", results, ["naive"])
            report_ratios(f"whole path ({mode}, {net_name})", results, ["naive"], target="triton")


if __name__ == "__main__":
    main()
