"""benchmarks/bench_reward_memory.py at small sizes: its official-loop restatement scores what flowkit scores (same
noise), and flowkit's scoring holds less memory than the official loop — at the benchmark's 4,096 tokens, |T| 4 and
3 layers with FlowReward's default rows per field call (at a narrower width: both sides' bytes scale with it), and at
the official loop's own rows per call. Memory is peak CPU-allocator bytes, deterministic for a shape; the speed ratio
is the benchmark's to measure, not a unit test's."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_reward_memory as bench  # noqa: E402

TIMESTEPS = [0.2, 0.4, 0.6, 0.8]


def test_official_restatement_scores_as_flowkit_with_the_same_noise():
    field, latents, mask = bench.setup(tokens=64, dim=32, depth=2)
    with torch.no_grad():
        official = bench.official_scores(field, latents, mask, TIMESTEPS, bench.flowkit_noise(64, len(TIMESTEPS), 32))
        ours = bench.flowkit_scores(field, latents, mask, TIMESTEPS, max_rows=100)
    assert official.abs().sum() > 0
    torch.testing.assert_close(ours, official, rtol=1e-4, atol=1e-6)


def test_flowkit_scoring_holds_less_memory_than_the_official_loop_at_the_default_rows_per_call():
    field, latents, mask = bench.setup(tokens=4096, dim=128, depth=1)
    with torch.no_grad():
        official = bench.peak_allocated_mb(lambda: bench.official_scores(field, latents, mask, TIMESTEPS))
        ours = bench.peak_allocated_mb(lambda: bench.flowkit_scores(field, latents, mask, TIMESTEPS))  # 8192 rows
    assert ours <= 0.8 * official, (ours, official)  # measured 0.69 (22.1 / 32.1 MiB)


def test_flowkit_scoring_holds_less_memory_than_the_official_loop_at_its_rows_per_call():
    tokens = 512
    field, latents, mask = bench.setup(tokens=tokens, dim=128, depth=2)
    with torch.no_grad():
        official = bench.peak_allocated_mb(lambda: bench.official_scores(field, latents, mask, TIMESTEPS))
        ours = bench.peak_allocated_mb(lambda: bench.flowkit_scores(field, latents, mask, TIMESTEPS, max_rows=tokens))
    assert ours <= official, (ours, official)
