"""SFT traces for the bundled tiny agents: an expert plays the real episodes, and the loss falls on its turns only;
the tiny chat tokenizer's template renders what its parser reads back."""

from __future__ import annotations

import re

import pytest
import torch

from flowkit.agents.envs.guess_number import guess_number_records
from flowkit.agents.envs.long_addition import add
from flowkit.agents.imitation import expert_trajectories, imitation_tensors
from flowkit.agents.runner import EpisodeOptions
from flowkit.agents.tools import parse_hermes, tool_schema
from flowkit.llm.tiny import chat_char_tokenizer, parse_chat

PRINTABLE = [chr(code) for code in range(32, 127)]


@pytest.fixture(scope="module")
def tokenizer():
    return chat_char_tokenizer(PRINTABLE)


def test_the_chat_tokenizer_keeps_tool_call_tags_and_its_parser_reads_its_rendering_back(tokenizer):
    call = '<tool_call>{"name": "add", "arguments": {"numbers": [7, 1, 5]}}</tool_call>'
    messages = [{"role": "user", "content": "347+281+905="}, {"role": "assistant", "content": call},
                {"role": "tool", "content": "13"}]
    text = tokenizer.apply_chat_template(messages, tools=[tool_schema(add)], tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<bos><|system|>tools: add<eos><|user|>347+281+905=<eos><|assistant|>" + call
                    + "<eos><|tool|>13<eos><|assistant|>")
    assert parse_chat(text) == [("system", "tools: add")] + [(m["role"], m["content"]) for m in messages] + [
        ("assistant", "")]
    ids = tokenizer.encode(call, add_special_tokens=False)
    assert len(ids) == len(call) - len("<tool_call></tool_call>") + 2  # each tag is one token
    assert parse_hermes(tokenizer.decode(ids, skip_special_tokens=True))[0].arguments == {"numbers": [7, 1, 5]}


def first_guess_then_the_secret(messages):
    """Guesses 50, then reads the secret off the answer it got ("higher": 51...), so turns depend on answers."""
    answers = [content for role, content in messages[1:] if role == "user"]
    return "\\boxed{50}" if not answers else ("\\boxed{51}" if answers[0] == "higher" else "\\boxed{49}")


def test_expert_traces_are_the_runners_ids_with_labels_on_the_experts_turns_only(tokenizer):
    records = [{"secret": secret, "low": 1, "high": 100, "max_guesses": 7} for secret in (49, 50, 51)]
    trajectories = expert_trajectories(tokenizer, first_guess_then_the_secret, parse_chat,
                                       EpisodeOptions("guess_number"), records)
    assert [len(t.policy_turns()) for t in trajectories] == [2, 1, 2]
    input_ids, attention_mask, labels = imitation_tensors(trajectories, tokenizer.pad_token_id)
    for row, trajectory in enumerate(trajectories):
        length = len(trajectory.token_ids)
        assert input_ids[row, :length].tolist() == list(trajectory.token_ids)
        assert attention_mask[row].sum() == length and (labels[row, length:] == -100).all()
        trained = labels[row][labels[row] != -100].tolist()
        turns = re.findall(r"<\|assistant\|>(.*?<eos>)", tokenizer.decode(trajectory.token_ids,
                                                                           skip_special_tokens=False))
        assert tokenizer.decode(trained, skip_special_tokens=False) == "".join(turns)
    assert torch.equal(labels != -100, torch.tensor(
        [list(t.loss_mask) + [0] * (input_ids.shape[1] - len(t.loss_mask)) for t in trajectories], dtype=torch.bool))


def test_an_expert_that_loses_an_episode_is_an_error_not_a_trace(tokenizer):
    with pytest.raises(RuntimeError, match="the expert failed 1 of 1 episodes; the first ended max_turns"):
        expert_trajectories(tokenizer, lambda messages: "\\boxed{50}", parse_chat,
                            EpisodeOptions("guess_number", max_turns=1), guess_number_records(1))
