"""The bundled environments played by scripted policies, and the bundled tiny chat model driving the runner through
the hf engine's token-in path."""

from __future__ import annotations

import json
import re

import pytest
import torch
from agent_fakes import ScriptedPolicy, drift_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from flowkit.agents import EpisodeOptions, EpisodeRunner, engine_generate, episode_metrics
from flowkit.agents.envs.guess_number import guess_number_records
from flowkit.agents.envs.long_addition import long_addition_records
from flowkit.llm.backbone import ASSETS
from flowkit.llm.hf_engine import HFRolloutEngine


@pytest.fixture(scope="module")
def tokenizer():
    return drift_tokenizer()


def column_adder(messages):
    """Adds column by column with the tool, carrying what each reply says, then boxes the sum (a wrong last digit
    when the prompt ends in 9, so that both rewards show)."""
    operands = next(content for role, content in messages if role == "user").rstrip("=").split("+")
    replies = [int(content) for role, content in messages if role == "tool"]
    column = len(replies)
    if column < len(operands[0]):
        digits = [int(operand[-1 - column]) for operand in operands]
        carry = replies[-1] // 10 if replies else 0
        arguments = {"numbers": digits + ([carry] if carry else [])}
        return "<tool_call>" + json.dumps({"name": "add", "arguments": arguments}) + "</tool_call>"
    total = sum(int(operand) for operand in operands)
    return f"\\boxed{{{total + 1 if operands[-1].endswith('9') else total}}}"


def test_long_addition_is_solved_with_one_add_call_per_column(tokenizer):
    records = long_addition_records("val")
    records = [r for r in records if r["prompt"].endswith("9=")][:2] + records[:6]
    runner = EpisodeRunner(ScriptedPolicy(tokenizer, column_adder), tokenizer, EpisodeOptions("long_addition"))
    trajectories = runner.run(records)
    for record, trajectory in zip(records, trajectories):
        assert trajectory.done and trajectory.counters["tool_calls"] == 3 and trajectory.counters["tool_errors"] == 0
        assert trajectory.final_reward == float(not record["prompt"].rstrip("=").endswith("9"))
    assert 0 < episode_metrics(trajectories)["episodes/success_rate"] < 1
    assert episode_metrics(trajectories)["episodes/turns_mean"] == 4


def binary_search(messages):
    low, high = map(int, re.findall(r"from (\d+) to (\d+)", messages[0][1])[0])
    for role, content in messages[1:-1]:  # the last is the open assistant turn
        if role == "assistant":
            guess = int(re.findall(r"\\boxed\{(\d+)\}", content)[0])
        elif content == "higher":
            low = guess + 1
        elif content == "lower":
            high = guess - 1
    return f"\\boxed{{{(low + high) // 2}}}"


def test_the_guessing_game_answers_each_guess_and_rewards_finding_the_number(tokenizer):
    records = guess_number_records(16, seed=3)
    assert records == guess_number_records(16, seed=3) and records[0]["max_guesses"] == 7
    runner = EpisodeRunner(ScriptedPolicy(tokenizer, binary_search), tokenizer, EpisodeOptions(
        environment="guess_number", max_turns=7))
    trajectories = runner.run(records)
    assert all(t.done and t.final_reward == 1.0 for t in trajectories)
    assert max(len(t.policy_turns()) for t in trajectories) > 1  # the hints were read and acted on
    [lucky] = runner.run([{"secret": 1, "low": 1, "high": 100, "max_guesses": 2}])  # 50, 25: out of guesses
    assert lucky.done and lucky.final_reward == 0.0 and len(lucky.policy_turns()) == 2


def test_the_tiny_chat_model_plays_through_the_hf_engines_token_in_path(single_thread):
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny_chat")
    engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(ASSETS / "tiny_chat"), tokenizer,
                             max_new_tokens=12)
    engine.policy_version = 5
    sampled = []

    def generate(prompts, max_new_tokens):
        samples = engine_generate(engine)(prompts, max_new_tokens)
        sampled.extend(samples)
        return samples

    runner = EpisodeRunner(generate, tokenizer, EpisodeOptions(environment="guess_number", max_turns=3,
                                                               max_tokens=120))
    trajectories = runner.run(guess_number_records(3))
    turns = [(t, turn) for t in trajectories for turn in t.policy_turns()]
    assert len(turns) == len(sampled) > 3  # every episode got past its first turn
    spans = sorted(tuple(t.token_ids[turn.start:turn.end]) for t, turn in turns)
    assert spans == sorted(tuple(sample.ids) for sample in sampled)
    for trajectory in trajectories:
        assert len(trajectory.token_ids) <= 120 and trajectory.stop_reason in ("done", "max_turns", "max_tokens")
        # the template writes <bos> and the tokenizer adds one: the prompt holds one, as single-turn prompts do
        bos = tokenizer.bos_token_id
        assert trajectory.token_ids[:1] == (bos,) and trajectory.token_ids.count(bos) == 1
        policy = [i for turn in trajectory.policy_turns() for i in range(turn.start, turn.end)]
        assert all(trajectory.versions[i] == 5 and trajectory.logprobs[i] <= 0 for i in policy)
