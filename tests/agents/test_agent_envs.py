"""The bundled environments played by scripted policies, and the bundled tiny chat model driving the runner through
the hf engine's token-in path."""

from __future__ import annotations

import json
import re

import pytest
import torch
from agent_fakes import ScriptedPolicy, drift_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from flowkit.agents import EpisodeOptions, EpisodeRunner, engine_generate, episode_metrics, tool_schema
from flowkit.agents.envs.calculator_math import MAX_EXPRESSION_CHARS, CalculatorMath, calculate
from flowkit.agents.envs.guess_number import guess_number_records
from flowkit.agents.envs.long_addition import long_addition_records
from flowkit.agents.tools import ToolBox, ToolCall
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


def test_the_calculator_is_described_to_the_model_by_its_signature_and_docstring():
    schema = tool_schema(calculate)["function"]
    assert schema["name"] == "calculate" and schema["description"].startswith("Evaluate an arithmetic expression")
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert schema["parameters"]["required"] == ["expression"]


@pytest.mark.parametrize("expression, value", [
    ("(347 + 281) * 3 / 4", "471"), ("-3**2", "-9"), ("2 ** -1", "0.5"), ("17 // 5 + 17 % 5", "5"),
    ("1 / 3", "0.333333333333333"), ("0.1 + 0.2", "0.3"), ("2 ** 4000 // 2 ** 3999", "2"),
])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("9**9**9", "too large"),                       # refused before it is computed: no hang
    ("(2**4000) * (2**4000)", "too large"),
    ("1e308 * 10", "too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 / 0", "ZeroDivisionError"),
    ("x + 1", "Name is not allowed"),
    ("__import__('os').system('true')", "Call is not allowed"),
    ("(1).real", "Attribute is not allowed"),
    ("'a' * 3", "Constant is not allowed"),
    ("True + 1", "Constant is not allowed"),
    ("[1, 2]", "List is not allowed"),
    ("1 +", "not an arithmetic expression"),
    ("(" * 300 + "1" + ")" * 300, "at most 500"),
    ("1+" * 5000 + "1", "at most 500"),
])
def test_hostile_expressions_are_error_observations_the_model_reads(expression, error):
    toolbox = ToolBox(CalculatorMath.tools, timeout=5.0, max_chars=4096, max_calls=8)
    reply = toolbox.run([ToolCall("calculate", {"expression": expression})])
    assert reply.errors == 1 and reply.timed_out is None
    [message] = reply.messages
    assert message["content"].startswith("error: ") and error in message["content"]
    assert len(message["content"]) < 200


@pytest.mark.parametrize("action, reward", [
    ("(347+281)*3/4 = 471, so \\boxed{471}", 1.0),
    ("\\boxed{470}", 0.0),
    ("the answer is 471", 0.0),                      # not boxed
    ("\\boxed{\\frac{942}{2}}", 1.0),                 # equal by the grader, not as text
])
def test_the_final_answer_is_graded_by_the_math_grader(action, reward):
    environment = CalculatorMath()
    assert environment.reset({"prompt": "What is (347+281)*3/4?", "answer": "471"}) == [
        {"role": "user", "content": "What is (347+281)*3/4?"}]
    assert environment.step(action) == (([], reward, True))


def calculator_user(messages):
    """Asks the calculator once (a hostile expression when the problem says so), then boxes its last reply."""
    replies = [content for role, content in messages if role == "tool"]
    if not replies:
        problem = next(content for role, content in messages if role == "user")
        expression = "9**9**9" if "hostile" in problem else problem.removeprefix("compute ")
        return "<tool_call>" + json.dumps({"name": "calculate", "arguments": {"expression": expression}}) + "</tool_call>"
    return f"\\boxed{{{replies[-1]}}}"


def test_a_calculator_episode_calls_the_tool_and_boxes_its_answer(tokenizer):
    records = [{"prompt": "compute 12*(3+4)", "answer": "84"}, {"prompt": "compute 2**10-1", "answer": "1023"},
               {"prompt": "hostile 9**9**9", "answer": "1"}]
    runner = EpisodeRunner(ScriptedPolicy(tokenizer, calculator_user), tokenizer,
                           EpisodeOptions("calculator_math", max_turns=3))
    trajectories = runner.run(records)
    assert [t.final_reward for t in trajectories] == [1.0, 1.0, 0.0]
    assert all(t.done and len(t.policy_turns()) == 2 and t.counters["tool_calls"] == 1 for t in trajectories)
    assert [t.counters["tool_errors"] for t in trajectories] == [0, 0, 1]
    hostile = tokenizer.decode(trajectories[2].token_ids)
    assert "error: ValueError: the result is too large" in hostile


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
