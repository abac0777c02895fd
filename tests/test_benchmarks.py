"""The benchmarks' own building blocks: the padded tokenizer of the random policies, the GPU scale rehearsal's
code path, run on CPU at toy size so that gpu_check.sh does not find it broken on a lent device, and the LM-head
softmax and packing benchmarks end to end."""

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_rl_memory import ALPHABET, padded_char_tokenizer  # noqa: E402


def test_padded_tokenizer_covers_the_vocab_and_encodes_characters():
    tokenizer = padded_char_tokenizer(1000)
    assert len(tokenizer) == 1000
    ids = tokenizer("47+38=")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + len("47+38=")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "47+38="
    assert max(ids) < 4 + len(set(ALPHABET))  # fillers are never produced by encoding
    assert tokenizer.decode([999]) == "<filler" + str(999 - 4 - len(set(ALPHABET))) + ">"  # a random policy's id decodes


def test_reward_signal_plants_each_error_kind_at_its_characters():
    import random

    from bench_reward_signal import error_positions, plant

    solution = "8+2=10,6+6+1=13\\boxed{130}"  # indices by hand: 8 + 2 = 1 0 , 6 + 6 + 1 = 1 3 \boxed{ 1 3 0 }
    assert error_positions(solution) == {"operand": [0, 2, 7, 9], "sum": [4, 5, 13, 14], "carry": [11],
                                         "boxed": [22, 23, 24]}
    assert error_positions("0+3=3,8+6=14\\boxed{143}")["carry"] == []
    assert plant("0+3=3,8+6=14\\boxed{143}", "carry", random.Random(0)) is None
    rng = random.Random(0)
    for _ in range(20):
        corrupted, index = plant(solution, "boxed", rng)
        assert index in (22, 23, 24) and corrupted[index] != solution[index] and corrupted[index].isdigit()
        assert corrupted[:index] + solution[index] + corrupted[index + 1:] == solution


def run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess:
    """``benchmarks/<script> *args`` on one thread; it must exit 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_scale_rehearsal_runs_on_cpu_at_toy_size(tmp_path):
    result = run_benchmark("bench_rl_scale.py", "--shape", "toy", "--device", "cpu", "--precision", "32-true",
                           "--steps", "1", "--prompts", "2", "--samples", "2", "--new-tokens", "8",
                           "--micro-batch-size", "2", "--rollout-batch-size", "4", "--kappa", "1",
                           "--csv", str(tmp_path / "results.csv"))
    step = next(line for line in result.stdout.splitlines() if line.startswith("step 0:"))
    for phase in ("step_s", "generate", "update", "flow", "flow_token_rewards"):
        assert f" {phase} " in step, step
    assert "(online flow loss in 0 pieces)" not in step, step  # κ = 1: the online flow step ran
    assert "peak memory: peak_rss" in result.stdout
    assert "rl_scale" in (tmp_path / "results.csv").read_text()


def test_logprob_entropy_benchmark_runs_at_toy_size(tmp_path):
    """bench_logprob_entropy.py end to end on a tiny chunk: both passes of each vocabulary timed and written."""
    result = run_benchmark("bench_logprob_entropy.py", "--rows", "5", "--vocab", "7,300", "--reps", "1",
                           "--csv", str(tmp_path / "results.csv"))
    timed = [line for line in result.stdout.splitlines() if "kernel / reference" in line]
    assert [line.split(":")[0].split()[-1] for line in timed] == ["forward", "backward"] * 2, result.stdout
    assert (tmp_path / "results.csv").read_text().count("logprob_entropy") == 4


def test_packing_benchmark_runs_at_toy_size(tmp_path):
    """bench_packing.py end to end on one prompt's 8 short rows, the LM head unchunked (its logits kept, one product
    fewer in the work it counts): both sides timed, the padding-free one with no padded position, one CSV row."""
    result = run_benchmark("bench_packing.py", "--prompts", "1", "--new-tokens", "16", "--rounds", "1",
                           "--token-budget", "0", "--lm-head-chunk", "0", "--csv", str(tmp_path / "results.csv"))
    sides = {line.split(":")[0].strip(): line for line in result.stdout.splitlines() if "update median" in line}
    assert sides.keys() == {"padded", "padding_free"}, result.stdout
    assert sides["padding_free"].endswith("perf/padding_frac 0.000")
    assert not sides["padded"].endswith("perf/padding_frac 0.000")  # the rows' lengths differ: the block pads
    with open(tmp_path / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["bench"] == "packing" and rows[0]["lm_head_chunk"] == ""


def test_kernels_step_benchmark_alternates_the_kernels(tmp_path, monkeypatch):
    """bench_kernels_step.py end to end at 4 steps (2 warm-up): one pair of steps timed and written; its callback
    turns flowkit's kernels off on odd steps only, and back on at the end."""
    from types import SimpleNamespace

    from bench_kernels_step import AlternateKernels

    from flowkit.kernels.backends import forced_backend

    monkeypatch.delenv("FLOWKIT_KERNELS", raising=False)
    callback, seen = AlternateKernels(), []
    for step in range(4):
        callback.on_train_batch_start(SimpleNamespace(global_step=step))
        seen.append(forced_backend())
    callback.on_train_end(None)
    assert seen == ["", "reference", "", "reference"] and forced_backend() == ""
    result = run_benchmark("bench_kernels_step.py", "--steps", "4", "--warmup", "2",
                           "--csv", str(tmp_path / "results.csv"))
    assert "(1 pairs, token budget 1024)" in result.stdout, result.stdout
    assert (tmp_path / "results.csv").read_text().count("kernels_step") == 1


def test_update_budget_benchmark_times_every_budget_on_the_same_experiences(tmp_path):
    """bench_update_budget.py end to end at one kept step and one round: each budget trains once on it, one row each;
    a budget given twice is refused before any work."""
    result = run_benchmark("bench_update_budget.py", "--steps", "1", "--rounds", "1", "--budgets", "0,512",
                           "--csv", str(tmp_path / "results.csv"))
    assert "micro_batch_tokens  none" in result.stdout and "micro_batch_tokens   512" in result.stdout, result.stdout
    assert result.stdout.count("(1 updates)") == 2
    assert (tmp_path / "results.csv").read_text().count("update_budget") == 2
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_update_budget.py"), "--budgets", "0,0"],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "distinct" in refused.stderr
