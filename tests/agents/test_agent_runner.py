"""The episode runner, token-in/token-out: exactly the sampled ids on every policy turn, the environment's messages
as the chat template's delta, loss_mask on policy tokens only; every fault bounded and counted; episodes that do
not wait for one another's tools."""

from __future__ import annotations

import json
import threading

import pytest
from agent_fakes import TEMPLATE, ScriptedPolicy, drift_tokenizer

from flowkit.agents import (
    ENVIRONMENTS, EnvStep, EpisodeOptions, EpisodeRunner, episode_metrics, register_environment, tool_schema,
)
from flowkit.agents.envs.long_addition import add, boxed_answer
from flowkit.errors import ConfigError, RunError

HANG = threading.Event()  # what a hanging call waits for; set when the test ends, so its daemon thread finishes


@pytest.fixture(scope="module")
def tokenizer():
    return drift_tokenizer()


@pytest.fixture(autouse=True)
def release_hung_calls():
    HANG.clear()
    yield
    HANG.set()


@pytest.fixture(scope="module", autouse=True)
def calculator_environment():
    """The test environments are registered while this module's tests run only (the option reference lists the
    registry's environments)."""
    register_environment("test_calculator")(Calculator)
    yield
    del ENVIRONMENTS["test_calculator"]


def explode(reason: str) -> str:
    """Fail.

    Args:
        reason: the error's message
    """
    raise RuntimeError(reason)


def flood(size: int) -> str:
    """A reply of ``size`` characters.

    Args:
        size: how many characters
    """
    return "x" * size


def hang() -> str:
    """Never return while the test runs."""
    HANG.wait(60)
    return "late"


class Calculator:
    """Answer ``record["answer"]`` in a box; reward 1 for it. Its ``reset`` / ``step`` fail as the record asks."""

    tools = (add, explode, flood, hang)

    def reset(self, record):
        if record.get("fault") == "reset_raises":
            raise ValueError("no such task")
        self.record = record
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, action):
        if self.record.get("fault") == "step_hangs":
            HANG.wait(60)
        if self.record.get("fault") == "bad_message":
            return [{"role": "user", "content": 42}], 0.0, False
        if self.record.get("fault") == "unknown_role":
            return [{"role": "narrator", "content": "the template raises on this role"}], 0.0, False
        if self.record.get("fault") == "continue":
            return EnvStep([{"role": "user", "content": "again"}], reward=0.5)
        return EnvStep([], reward=float(boxed_answer(action) == self.record["answer"]), done=True)


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


CALLS = {  # the policy's first turn per record "prompt"
    "12+47=": call("add", numbers=[12, 47]),
    "malformed": "<tool_call>{\"name\": add}</tool_call>",
    "unknown": call("subtract", numbers=[1]),
    "raises": call("explode", reason="boom"),
    "flood": call("flood", size=10_000_000),
    "many": call("add", numbers=[1]) * 1000,
    "hang": call("hang"),
}


def calculator_policy(messages):
    """Call the record's tool once, then answer 59."""
    prompt = next(content for role, content in messages if role == "user")
    tool_replies = sum(role == "tool" for role, _ in messages)
    if prompt in CALLS and tool_replies == 0:
        return CALLS[prompt]
    return "\\boxed{59}"


def run(tokenizer, records, policy=calculator_policy, **options):
    scripted = ScriptedPolicy(tokenizer, policy)
    runner = EpisodeRunner(scripted, tokenizer, EpisodeOptions(environment="test_calculator", **options))
    return runner.run(records), scripted


def contains(sequence, part):
    return any(sequence[i:i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


def test_the_trajectory_keeps_every_sampled_id_where_re_tokenizing_would_change_them(tokenizer):
    [trajectory], policy = run(tokenizer, [{"prompt": "12+47=", "answer": "59"}])
    assert trajectory.done and trajectory.final_reward == 1.0 and trajectory.counters["tool_calls"] == 1
    sampled = [sample for _, sample in policy.samples]
    turns = trajectory.policy_turns()
    assert len(turns) == len(sampled) == 2
    for turn, sample in zip(turns, sampled):
        assert list(trajectory.token_ids[turn.start:turn.end]) == list(sample.ids)
        assert list(trajectory.logprobs[turn.start:turn.end]) == list(sample.logprobs)
        assert list(trajectory.versions[turn.start:turn.end]) == list(sample.versions)
    # the text is the chat template's rendering of the conversation, turn separators included ...
    messages = [{"role": "user", "content": "12+47="}, {"role": "assistant", "content": CALLS["12+47="]},
                {"role": "tool", "name": "add", "content": "59"}, {"role": "assistant", "content": "\\boxed{59}"}]
    rendered = tokenizer.apply_chat_template(messages, tools=[tool_schema(t) for t in Calculator.tools], tokenize=False)
    assert tokenizer.decode(trajectory.token_ids, skip_special_tokens=False) + "\n" == rendered
    # ... whose re-tokenization (what a runner that renders the whole conversation trains on) loses the policy's ids
    naive = tokenizer.encode(rendered, add_special_tokens=False)
    assert not contains(naive, list(sampled[0].ids)) and len(naive) < len(trajectory.token_ids)


def test_a_template_that_closes_turns_with_other_text_gets_its_closing_after_the_stop_token():
    tokenizer = drift_tokenizer()
    tokenizer.chat_template = TEMPLATE.replace("<eos>", "[end]")
    [trajectory], _ = run(tokenizer, [{"prompt": "12+47=", "answer": "59"}])
    messages = [{"role": "user", "content": "12+47="}, {"role": "assistant", "content": CALLS["12+47="]},
                {"role": "tool", "name": "add", "content": "59"}, {"role": "assistant", "content": "\\boxed{59}"}]
    rendered = tokenizer.apply_chat_template(messages, tools=[tool_schema(t) for t in Calculator.tools], tokenize=False)
    text = tokenizer.decode(trajectory.token_ids, skip_special_tokens=False)
    assert text.count("<eos>") == 2 and text.replace("<eos>", "") + "[end]\n" == rendered


def test_loss_mask_logprobs_and_versions_mark_exactly_the_policy_tokens(tokenizer):
    trajectories, _ = run(tokenizer, [{"prompt": "12+47=", "answer": "59"}, {"prompt": "3+4=", "answer": "7"}])
    for trajectory in trajectories:
        policy = {i for turn in trajectory.policy_turns() for i in range(turn.start, turn.end)}
        assert {i for i, m in enumerate(trajectory.loss_mask) if m} == policy
        assert all(trajectory.logprobs[i] == 0.0 and trajectory.versions[i] == -1
                   for i in range(len(trajectory.token_ids)) if i not in policy)
        assert all(trajectory.logprobs[i] < 0 for i in policy)
        # the turns tile the trajectory, starting with the prompt and alternating with the policy
        assert [turn.start for turn in trajectory.turns[1:]] == [turn.end for turn in trajectory.turns[:-1]]
        assert trajectory.turns[0].role == "prompt" and trajectory.turns[-1].end == len(trajectory.token_ids)
        roles = [turn.role for turn in trajectory.turns]
        assert roles[1::2] == ["policy"] * len(roles[1::2])
        assert len({len(trajectory.token_ids), len(trajectory.loss_mask), len(trajectory.logprobs),
                     len(trajectory.versions)}) == 1


@pytest.mark.parametrize("prompt, counter, shown", [
    ("malformed", "tool_errors", "malformed tool call"),
    ("unknown", "tool_errors", "unknown tool 'subtract'"),
    ("raises", "tool_errors", "RuntimeError: boom"),
    ("flood", "tool_replies_truncated", "more characters]"),
    ("many", "tool_calls_over_limit", "at most 8 tool calls per turn; 992 not run"),
])
def test_a_faulty_tool_call_is_an_observation_the_model_reads_and_is_counted(tokenizer, prompt, counter, shown):
    # room for a turn of 1,000 calls; replies cut at 1,000 characters
    [trajectory], _ = run(tokenizer, [{"prompt": prompt, "answer": "59"}], max_tokens=100_000,
                          max_tool_reply_chars=1000)
    assert trajectory.done and trajectory.final_reward == 1.0  # the episode went on to its answer
    assert trajectory.counters[counter] >= 1
    [reply] = [turn for turn in trajectory.turns if turn.role == "tool"]
    text = tokenizer.decode(trajectory.token_ids[reply.start:reply.end])
    assert shown in text
    assert len(text) < 9 * 1100  # at most 8 replies of 1,000 characters and the over-limit note
    metrics = episode_metrics([trajectory])
    assert metrics[f"episodes/{counter}"] == trajectory.counters[counter]


@pytest.mark.parametrize("fault, reason, counter", [
    ("hang", "tool_timeout", "tool_timeouts"),
    ("step_hangs", "env_timeout", "env_timeouts"),
    ("bad_message", "env_error", "env_errors"),
    ("unknown_role", "env_error", "env_errors"),
    ("reset_raises", "env_error", "env_errors"),
])
def test_a_hang_or_a_broken_environment_ends_only_its_episode_counted(tokenizer, fault, reason, counter):
    records = [{"prompt": fault if fault == "hang" else "3+4=", "answer": "59", "fault": fault},
               {"prompt": "12+47=", "answer": "59"}]
    broken, healthy = run(tokenizer, records, call_timeout=2.0)[0]
    assert broken.stop_reason == reason and broken.counters[counter] == 1 and "\n" not in broken.error
    assert healthy.done and healthy.final_reward == 1.0 and healthy.error is None
    assert episode_metrics([broken, healthy])["episodes/fault_rate"] == 0.5


def test_an_environment_that_fails_every_episode_is_one_line_naming_it(tokenizer):
    with pytest.raises(RunError, match=r"environment 'test_calculator' failed in all 2 episodes; the first: reset: "
                                       r"ValueError: no such task") as error:
        run(tokenizer, [{"prompt": "1", "fault": "reset_raises"}] * 2)
    assert "\n" not in str(error.value)


def test_turn_and_token_bounds_end_episodes_as_truncated(tokenizer):
    [turns], _ = run(tokenizer, [{"prompt": "3+4=", "answer": "7", "fault": "continue"}], max_turns=3)
    assert turns.stop_reason == "max_turns" and turns.truncated and turns.turn_rewards == (0.5, 0.5, 0.5)
    assert turns.turns[-1].role == "policy"  # no answer rendered after the last turn
    [tokens], _ = run(tokenizer, [{"prompt": "3+4=", "answer": "7", "fault": "continue"}], max_tokens=60)
    assert tokens.stop_reason == "max_tokens" and tokens.truncated and len(tokens.token_ids) <= 60
    assert sum(tokens.loss_mask) > 0
    [unfit], policy = run(tokenizer, [{"prompt": "3+4=", "answer": "7"}], max_tokens=5)  # not even the prompt fits
    assert unfit.stop_reason == "max_tokens" and unfit.token_ids == () and policy.calls == 0


def test_user_errors_are_one_line_before_any_episode(tokenizer):
    with pytest.raises(ConfigError, match="EpisodeOptions.environment must be one of .*test_calculator.*, got "
                                          "'test_calculater'; did you mean 'test_calculator'"):
        EpisodeRunner(lambda *_: [], tokenizer, EpisodeOptions(environment="test_calculater"))
    with pytest.raises(ConfigError, match="EpisodeOptions.max_turns must be >= 1, got 0"):
        EpisodeRunner(lambda *_: [], tokenizer, EpisodeOptions(environment="test_calculator", max_turns=0))
    with pytest.raises(ConfigError, match="tool_parser must be one of"):
        EpisodeRunner(lambda *_: [], tokenizer, EpisodeOptions(environment="test_calculator", tool_parser="json"))


def test_an_episode_waits_for_the_engine_not_for_another_episodes_tool(tokenizer, monkeypatch):
    """The slow episode's tool blocks until the fast episode has been given its third turn: a runner that waited for
    every tool before generating again would never get there (the tool would time out after 30 s)."""
    released = threading.Event()

    def wait_for_release() -> str:
        """Wait until the other episode has moved on."""
        return "released" if released.wait(30) else "still blocked"

    class TwoSpeeds(Calculator):
        tools = (add, wait_for_release)

    monkeypatch.setitem(ENVIRONMENTS, "test_two_speeds", TwoSpeeds)

    def policy(messages):
        prompt = next(content for role, content in messages if role == "user")
        replies = sum(role == "tool" for role, _ in messages)
        if prompt == "slow":
            return call("wait_for_release") if replies == 0 else "\\boxed{59}"
        return call("add", numbers=[replies]) if replies < 2 else "\\boxed{59}"

    def on_call(index, prompts):
        if any(tokenizer.decode(p, skip_special_tokens=False).count("<|tool|>") == 2 for p in prompts):
            released.set()  # the fast episode's third turn is being generated

    scripted = ScriptedPolicy(tokenizer, policy, on_call)
    runner = EpisodeRunner(scripted, tokenizer, EpisodeOptions(environment="test_two_speeds", call_timeout=60))
    slow, fast = runner.run([{"prompt": "slow", "answer": "59"}, {"prompt": "fast", "answer": "59"}])
    assert slow.done and fast.done and len(fast.policy_turns()) == 3
    [reply] = [turn for turn in slow.turns if turn.role == "tool"]
    assert tokenizer.decode(slow.token_ids[reply.start:reply.end]).count("released") == 1
