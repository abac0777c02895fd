"""Peak memory and speed of flowkit's flow-reward scoring vs the official per-layer loop, side by side, one thread.

    python benchmarks/bench_reward_memory.py                 # 4,096 tokens, d 512, |T| 4, 3 tapped layers
    python benchmarks/bench_reward_memory.py --tokens 1024 --reps 3

Both sides score the same latents with the same weights (a depth-4 ``VelocityField`` conditioned on the previous
token's latent, the official RL scripts' ``token_post``), under ``no_grad``:

* ``official``: a plain-PyTorch re-statement of the official RLFR scoring loop (its ``FlowReward.forward``, called
  once per tapped layer) — for each layer ℓ draw ε ~ N(0, I) once, then for each rewarding timestep t:
  x_t = t·x1 + (1 − t)·ε and u_t = x1 − ε, one network call v = v_φ(x_t, t, c, ℓ) over all N tokens, and add
  t/(1 − t)·mean_d (v − u_t)² (RLFR eqs. 5, 7; each t with its own weight, as flowkit's eq. 7 — the official code
  weights all with the last t's), the network written as the official code writes it (:func:`official_velocity`);
* ``flowkit``: :func:`flowkit.rewards.flow.velocity_deviation_scores` as ``FlowReward.score`` calls it (its default rows per
  field call; the fused kernels regenerate ε instead of storing it).

Peak memory: the largest sum of live CPU-allocator bytes during one call (torch's profiler records every allocation
and free, the field's and the kernels' included), over what was allocated before — deterministic for a given shape.
Time: median wall time over ``--reps`` calls after a warm-up, the sides taking turns. The scores of the two
sides agree when the official loop is handed flowkit's noise (checked each run). Appends one row per side to the CSV.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_csv, timestamp

from flowkit import kernels
from flowkit.rewards.flow import VelocityField, velocity_deviation_scores
from flowkit.rewards.flow.matching import DEFAULT_MAX_ROWS
from flowkit.rewards.flow.field import modulate, sinusoidal_embedding

SEED = 1234
LAYER_POSITIONS = (0.25, 0.5, 0.75)


def official_velocity(field: VelocityField, x_t: torch.Tensor, t: torch.Tensor, layer: torch.Tensor,
                      condition: torch.Tensor) -> torch.Tensor:
    """The official network's forward with ``field``'s weights, as the official (DiT-style adaLN MLP) code writes it:
    each row's t and ℓ embedded (sinusoidal features → MLP), and every block applying its own SiLU to y, modulating
    x·(1 + scale) + shift and adding gate·MLP out of place. flowkit's forward computes the same function."""
    def embed(embedder, values):
        return embedder.mlp(sinusoidal_embedding(values, embedder.frequencies))

    y = embed(field.t_embed, t) + embed(field.layer_embed, layer) + field.cond_proj(condition)
    x = field.input_proj(x_t)
    for block in field.blocks:
        shift, scale, gate = block.ada_ln(y).chunk(3, dim=-1)
        x = x + gate * block.mlp(modulate(block.norm(x), shift, scale))
    shift, scale = field.final_ada_ln(y).chunk(2, dim=-1)
    return field.output_proj(modulate(field.final_norm(x), shift, scale))


def official_scores(field: VelocityField, latents: torch.Tensor, response_mask: torch.Tensor,
                    timesteps: list[float], noise: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None):
    """The official per-layer scoring loop (see the module docstring): B×S scores, zero where not scored.

    ``noise(layer, timestep_index, x1)`` gives ε, so a check can hand it flowkit's (one draw per layer and timestep);
    by default one ``torch.randn_like`` per layer, shared by its timesteps, as the official code draws it."""
    response = response_mask.bool()
    scored = response.clone()
    scored[:, 0] = False  # the condition is the previous token's latent
    rows, cols = scored.nonzero(as_tuple=True)
    total = torch.zeros(len(rows))
    for layer, position in enumerate(LAYER_POSITIONS):
        x1, cond = latents[layer, rows, cols], latents[layer, rows, cols - 1]
        layer_rows = torch.full((len(rows),), position)
        layer_noise = torch.randn_like(x1) if noise is None else None
        for index, t in enumerate(timesteps):
            eps = layer_noise if noise is None else noise(layer, index, x1)
            x_t, u_t = t * x1 + (1 - t) * eps, x1 - eps
            v = official_velocity(field, x_t, torch.full((len(rows),), t), layer_rows, cond)
            total += t / (1 - t) * ((v - u_t) ** 2).mean(-1)
    scores = torch.zeros(scored.shape)
    scores[rows, cols] = total / (len(LAYER_POSITIONS) * len(timesteps))
    return scores


def flowkit_scores(field: VelocityField, latents: torch.Tensor, response_mask: torch.Tensor, timesteps: list[float],
                   max_rows: int | None = DEFAULT_MAX_ROWS) -> torch.Tensor:
    return velocity_deviation_scores(field, latents, response_mask, LAYER_POSITIONS, timesteps, SEED,
                                     condition="previous", max_rows=max_rows)


def flowkit_noise(num_tokens: int, num_times: int, dim: int) -> Callable[[int, int, torch.Tensor], torch.Tensor]:
    """ε of (layer p, timestep t) for all tokens as flowkit's kernels draw it: counters ((n·P + p)·T + t)·d + j."""
    def noise(layer: int, index: int, x1: torch.Tensor) -> torch.Tensor:
        stride = len(LAYER_POSITIONS) * num_times * dim
        flat = kernels.flow_noise((num_tokens * stride,), SEED)
        return flat.view(num_tokens, len(LAYER_POSITIONS), num_times, dim)[:, layer, index]
    return noise


def peak_allocated_mb(fn: Callable[[], object]) -> float:
    """The largest sum of live CPU-allocator bytes during ``fn()`` above those live before it, in MiB."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return max(itertools.accumulate((nbytes for _, nbytes in events), initial=0)) / 2**20


def interleaved_ms(sides: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Wall times of ``reps`` calls per side after one warm-up each, the sides taking turns, so that a machine whose
    load drifts slows every side alike."""
    for fn in sides.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(reps):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def setup(tokens: int, dim: int, depth: int) -> tuple[VelocityField, torch.Tensor, torch.Tensor]:
    """A field with non-zero output layers (a fresh one outputs v = 0) and latents of ``tokens`` scored tokens."""
    torch.manual_seed(0)
    field = VelocityField(dim, depth=depth, conditioned=True).eval()
    with torch.no_grad():
        for param in field.parameters():
            param.normal_(0, 0.02)
    rows, length = 4, tokens // 4 + 1
    latents = torch.randn(len(LAYER_POSITIONS), rows, length, dim)
    mask = torch.ones(rows, length)
    return field, latents, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="scored tokens (a multiple of 4)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--timesteps", type=float, nargs="+", default=[0.2, 0.4, 0.6, 0.8])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-rows", type=int, nargs="+", default=[DEFAULT_MAX_ROWS],
                        help="flowkit's field rows per call (FlowReward.max_rows_per_call); one flowkit side each")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    field, latents, mask = setup(args.tokens, args.dim, args.depth)
    sides = {"official": lambda: official_scores(field, latents, mask, args.timesteps)}
    for rows in args.max_rows:
        sides[f"flowkit {rows} rows"] = lambda rows=rows: flowkit_scores(field, latents, mask, args.timesteps, rows)
    with torch.no_grad():
        same_noise = official_scores(field, latents, mask, args.timesteps,
                                     flowkit_noise(args.tokens, len(args.timesteps), args.dim))
        gap = float((flowkit_scores(field, latents, mask, args.timesteps) - same_noise).abs().max())
        times = interleaved_ms(sides, args.reps)
        results = {name: {"median_ms": statistics.median(times[name]), "peak_mb": peak_allocated_mb(fn)}
                   for name, fn in sides.items()}
    size = f"N{args.tokens}d{args.dim}T{len(args.timesteps)}P{len(LAYER_POSITIONS)}depth{args.depth}"
    print(f"reward scoring, {size}, 1 thread (scores with the same noise agree to {gap:.1e})")
    for name, result in results.items():
        print(f"  {name:20s} {result['median_ms']:9.1f} ms  peak {result['peak_mb']:8.1f} MiB")
        append_csv(args.csv, {"timestamp": timestamp(), "benchmark": "reward_memory", "implementation": name,
                              "device": "cpu", "dtype": "float32", "size": size, "threads": 1,
                              "median_ms": round(result["median_ms"], 2), "peak_mem_mb": round(result["peak_mb"], 2)})
    official = results.pop("official")
    for name, ours in results.items():
        print(f"{name} / official: memory {ours['peak_mb'] / official['peak_mb']:.2f}x, "
              f"speed {official['median_ms'] / ours['median_ms']:.2f}x")


if __name__ == "__main__":
    main()
