"""Agentic episodes: do slow tools cost the batch their latency per episode, or is it hidden?

    python benchmarks/bench_episodes.py [--episodes 64] [--tool-ms 50] [--step-ms 5] [--reps 3]

A batch of ``--episodes`` long-addition episodes (:mod:`flowkit.agents.envs.long_addition`, 3 operands: three
``add`` calls, one per column, then the answer — four policy turns) runs through :class:`flowkit.agents.EpisodeRunner`
with a scripted policy whose ``generate`` costs what a batched decoder does: ``--step-ms`` per decoding step, as many
steps as the longest sample of the call (a GPU decodes a batch of 64 about as fast as one row). Arms, alternating in
one run, the median of ``--reps`` each:

- ``instant``: tools that return at once;
- ``slow``: tools that take ``--tool-ms`` per call, with the runner's thread pool (one worker per episode);
- ``slow_serial``: the same tools with one worker, i.e. every tool call of the batch one after another (what a
  runner that calls tools in its generation loop pays).

Reports each arm's wall time and slow / instant (issue 43's bound: ≤ 1.3 at 50 ms) and slow_serial / instant,
appended to the results CSV.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import string
import sys
import time
from pathlib import Path

from flowkit.agents import EpisodeOptions, EpisodeRunner, Sample, register_environment
from flowkit.agents.envs.long_addition import LongAddition, long_addition_records
from flowkit.llm.tiny import char_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_csv, timestamp  # noqa: E402

TEMPLATE = ("{{ bos_token }}{% for message in messages %}<{{ message.role }}>{{ message.content }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
TOOL_SECONDS = [0.0]  # the arm's tool latency, read by the tool


def add(numbers: list[int]) -> int:
    """Add whole numbers, such as one column's digits and the carry from the column below.

    Args:
        numbers: the numbers to add
    """
    time.sleep(TOOL_SECONDS[0])
    return sum(numbers)


@register_environment("bench_addition")
class TimedAddition(LongAddition):
    tools = (add,)


def column_adder(text: str) -> str:
    """The next turn of a policy that adds column by column with the tool, then boxes the sum."""
    operands = text.split("<user>")[1].split("=")[0].split("+")
    replies = [int(reply.split("<eos>")[0]) for reply in text.split("<tool>")[1:]]
    if len(replies) < len(operands[0]):
        carry = replies[-1] // 10 if replies else 0
        digits = [int(operand[-1 - len(replies)]) for operand in operands] + ([carry] if carry else [])
        return "<tool_call>" + json.dumps({"name": "add", "arguments": {"numbers": digits}}) + "</tool_call>"
    return f"\\boxed{{{sum(int(operand) for operand in operands)}}}"


def scripted_generate(tokenizer, step_seconds: float, calls: list[int]):
    """The scripted policy's ``generate``, appending each call's batch size to ``calls``."""

    def generate(prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        calls.append(len(prompts))
        samples = []
        for prompt in prompts:
            text = column_adder(tokenizer.decode(prompt, skip_special_tokens=False))
            ids = tokenizer.convert_tokens_to_ids(list(text)) + [tokenizer.eos_token_id]
            samples.append(Sample(ids, [-0.1] * len(ids), [0] * len(ids)))
        time.sleep(step_seconds * max(len(sample.ids) for sample in samples))  # the decoder's steps
        return samples

    return generate


def run_arm(runner: EpisodeRunner, records: list[dict], tool_seconds: float) -> float:
    TOOL_SECONDS[0] = tool_seconds
    start = time.perf_counter()
    trajectories = runner.run(records)
    elapsed = time.perf_counter() - start
    assert all(t.done and t.final_reward == 1.0 and len(t.policy_turns()) == 4 for t in trajectories)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--tool-ms", type=float, default=50.0, help="latency of each tool call in the slow arms")
    parser.add_argument("--step-ms", type=float, default=5.0, help="the fake decoder's time per decoding step")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()

    tokenizer = char_tokenizer(string.printable)
    tokenizer.chat_template = TEMPLATE
    records = long_addition_records("test", operands=3)[:args.episodes]
    calls: list[int] = []
    generate = scripted_generate(tokenizer, args.step_ms / 1000, calls)
    pooled = EpisodeRunner(generate, tokenizer, EpisodeOptions(environment="bench_addition", workers=args.episodes))
    serial = EpisodeRunner(generate, tokenizer, EpisodeOptions(environment="bench_addition", workers=1))
    tool_seconds = args.tool_ms / 1000
    arms = {"instant": (pooled, 0.0), "slow": (pooled, tool_seconds), "slow_serial": (serial, tool_seconds)}
    times: dict[str, list[float]] = {name: [] for name in arms}
    batches: dict[str, list[int]] = {}
    for _ in range(args.reps):
        for name, (runner, latency) in arms.items():
            calls.clear()
            times[name].append(run_arm(runner, records, latency))
            batches[name] = list(calls)
    median = {name: statistics.median(values) for name, values in times.items()}
    load = os.getloadavg()[0]
    for name, seconds in median.items():
        print(f"{name:12s} {seconds:7.3f} s  (runs: {', '.join(f'{t:.3f}' for t in times[name])}; "
              f"generate batches of the last run: {batches[name]})")
    ratio, serial_ratio = median["slow"] / median["instant"], median["slow_serial"] / median["instant"]
    print(f"slow / instant = {ratio:.3f} (bound 1.3), slow_serial / instant = {serial_ratio:.2f}; "
          f"{args.episodes} episodes x 4 turns, tools {args.tool_ms:g} ms, decoding {args.step_ms:g} ms/step, "
          f"load average {load:.2f}")
    for name, seconds in median.items():
        append_csv(args.csv, {"benchmark": "episodes", "implementation": name, "device": "cpu",
                              "median_ms": seconds * 1e3, "ratio_vs_instant": seconds / median["instant"],
                              "episodes": args.episodes, "tool_ms": args.tool_ms, "step_ms": args.step_ms,
                              "load_average": load, "timestamp": timestamp()})


if __name__ == "__main__":
    main()
