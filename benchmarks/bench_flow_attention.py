"""Benchmark flow-token attention over a frozen last layer (explanation rewards) per implementation and size.

Implementations: ``reference`` (flowkit's PyTorch reference, full score tensor), ``sdpa`` (projection + RoPE as in
flowkit, then ``scaled_dot_product_attention`` over per-evaluation keys [context, flow] with a boolean prefix mask
— the naive "append the flow tokens" computation on PyTorch's fused attention), ``native`` (flowkit._C: C++ on
CPU, CUDA on GPU) and ``triton`` (CUDA only). ``--backward`` times forward + backward w.r.t. the flow tokens.
Effective GB/s counts the context K/V each evaluation reads (its prefix) once.

Usage: python benchmarks/bench_flow_attention.py [--device cpu] [--sizes B,S,H,Hkv,dh,N,d;...] [--backward]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_csv, measure, timestamp

from flowkit.kernels import available_backends, flow_token_attention
from flowkit.kernels.reference import flow_attention as reference

CPU_SIZES = "2,16,8,2,64,512,512;1,8,8,8,64,1024,512"
GPU_SIZES = "4,64,32,8,128,2048,4096;8,32,28,4,128,4096,3584;2,128,32,32,128,1024,4096"
NUM_FLOW = 2


def make_inputs(batch, steps, heads, kv_heads, head_dim, context, hidden, device, dtype):
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=dtype) * scale

    prefix = torch.randint(context // 2, context + 1, (batch, steps), device=device)
    return dict(
        flow_hidden=rand(batch, steps, NUM_FLOW, hidden).requires_grad_(),
        q_weight=rand(heads * head_dim, hidden, scale=hidden ** -0.5),
        k_weight=rand(kv_heads * head_dim, hidden, scale=hidden ** -0.5),
        v_weight=rand(kv_heads * head_dim, hidden, scale=hidden ** -0.5),
        q_bias=rand(heads * head_dim), k_bias=rand(kv_heads * head_dim), v_bias=rand(kv_heads * head_dim),
        context_k=rand(batch, kv_heads, context, head_dim), context_v=rand(batch, kv_heads, context, head_dim),
        prefix_lengths=prefix, flow_positions=prefix.unsqueeze(-1) + torch.arange(NUM_FLOW, device=device),
        inv_freq=1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim),
        attention_scaling=1.0, num_heads=heads, num_kv_heads=kv_heads,
    )


def sdpa_attention(flow_hidden, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, context_k, context_v,
                   prefix_lengths, flow_positions, inv_freq, attention_scaling, num_heads, num_kv_heads):
    """Same result via SDPA on keys [context (N), flow (F)] per evaluation, masked to the prefix."""
    q, k, v = reference.project_flow_tokens(flow_hidden, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias,
                                            flow_positions, inv_freq, attention_scaling, num_heads, num_kv_heads)
    batch, steps, num_flow = q.shape[:3]
    context = context_k.shape[2]
    keys = torch.cat((context_k.unsqueeze(1).expand(-1, steps, -1, -1, -1), k.permute(0, 1, 3, 2, 4)), dim=3)
    values = torch.cat((context_v.unsqueeze(1).expand(-1, steps, -1, -1, -1), v.permute(0, 1, 3, 2, 4)), dim=3)
    visible = torch.arange(context + num_flow, device=q.device) < prefix_lengths.unsqueeze(-1)
    visible[..., context:] = True
    out = F.scaled_dot_product_attention(
        q.permute(0, 1, 3, 2, 4).flatten(0, 1), keys.flatten(0, 1), values.flatten(0, 1),
        attn_mask=visible.flatten(0, 1)[:, None, None, :], enable_gqa=num_heads != num_kv_heads)
    return out.unflatten(0, (batch, steps)).permute(0, 1, 3, 2, 4).flatten(-2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16/float16 (GPU default bfloat16)")
    parser.add_argument("--sizes", default=None, help="';'-separated B,S,H,Hkv,dh,N,d")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = args.device
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    sizes = args.sizes or (GPU_SIZES if device == "cuda" else CPU_SIZES)
    impls = ["reference", "sdpa"] + [b for b in ("native", "triton") if b in available_backends(device)
                                     and (b != "triton" or device == "cuda")]
    for size in filter(None, sizes.split(";")):
        batch, steps, heads, kv_heads, head_dim, context, hidden = map(int, size.split(","))
        kwargs = make_inputs(batch, steps, heads, kv_heads, head_dim, context, hidden, device, dtype)
        element = torch.finfo(dtype).bits // 8
        bytes_moved = element * (2 * kv_heads * head_dim * int(kwargs["prefix_lengths"].sum())
                                 + 2 * batch * steps * NUM_FLOW * heads * head_dim)
        label = f"B{batch}S{steps}H{heads}Hkv{kv_heads}dh{head_dim}N{context}d{hidden}"
        results = {}
        for impl in impls:
            os.environ["FLOWKIT_KERNELS"] = impl if impl in ("native", "triton") else "reference"
            attention = sdpa_attention if impl == "sdpa" else flow_token_attention

            def fn(attention=attention):
                if args.backward:
                    attention(**kwargs).float().sum().backward()
                else:
                    with torch.no_grad():
                        attention(**kwargs)

            stats = measure(fn, warmup=args.warmup, reps=args.reps, device=device)
            results[impl] = stats
            row = dict(benchmark="flow_attention" + ("_fwd_bwd" if args.backward else ""), implementation=impl,
                       device=device, dtype=str(dtype).removeprefix("torch."), size=label, **stats,
                       gbps=bytes_moved / stats["median_ms"] / 1e6, timestamp=timestamp())
            append_csv(args.csv, row)
            mem = "n/a" if stats["peak_mem_mb"] is None else f"{stats['peak_mem_mb']:.0f}"
            print(f"{row['benchmark']:22s} {impl:10s} {label:36s} median {stats['median_ms']:9.3f} ms "
                  f"(p20 {stats['p20_ms']:.3f}, p80 {stats['p80_ms']:.3f})  {row['gbps']:7.1f} GB/s  peak +{mem} MB",
                  flush=True)
        for fast in ("native", "triton"):
            for base in ("sdpa", "reference"):
                if fast in results:
                    ratio = results[base]["median_ms"] / results[fast]["median_ms"]
                    print(f"  {fast} is {ratio:.2f}x the speed of {base}")


if __name__ == "__main__":
    main()
