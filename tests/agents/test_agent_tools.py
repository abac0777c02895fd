"""Tools: schemas from type hints and docstrings, the Hermes parser, and the ToolBox's bounds."""

from __future__ import annotations

import threading

import pytest

from flowkit.agents.envs.long_addition import add
from flowkit.agents.tools import (
    CallTimeout, MalformedToolCall, ToolBox, ToolCall, call_with_timeout, parse_hermes, tool_schema,
)
from flowkit.errors import ConfigError


def test_a_tools_schema_comes_from_its_type_hints_and_docstring():
    schema = tool_schema(add)["function"]
    assert schema["name"] == "add" and schema["description"].startswith("Add whole numbers")
    assert schema["parameters"]["properties"]["numbers"] == {"type": "array", "items": {"type": "integer"},
                                                             "description": "the numbers to add"}
    assert schema["parameters"]["required"] == ["numbers"]


def test_a_tool_the_model_cannot_be_told_about_is_one_line_naming_it():
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match="tool 'undocumented' cannot be described to the model") as error:
        ToolBox((add, undocumented), timeout=1, max_chars=10, max_calls=1)
    assert "\n" not in str(error.value)


def test_hermes_calls_are_read_in_order_and_a_bad_one_is_marked_not_dropped():
    text = ('I will add. <tool_call>{"name": "add", "arguments": {"numbers": [1, 2]}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"numbers\\": [3]}"}</tool_call>'
            '<tool_call>{"name": add}</tool_call><tool_call>["add"]</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"numbers": [4]}}')  # left open at the end of the turn
    calls = parse_hermes(text)
    assert calls[:2] == [ToolCall("add", {"numbers": [1, 2]}), ToolCall("add", {"numbers": [3]})]
    assert [type(c) for c in calls[2:4]] == [MalformedToolCall, MalformedToolCall]
    assert calls[4] == ToolCall("add", {"numbers": [4]})
    assert parse_hermes("\\boxed{12}") == []


def test_the_toolbox_answers_every_fault_with_an_error_message_and_counts_it():
    def explode() -> str:
        """Fail."""
        raise RuntimeError("boom")

    box = ToolBox((add, explode), timeout=5, max_chars=100, max_calls=8)
    reply = box.run([ToolCall("add", {"numbers": [1, 2]}), ToolCall("add", {"numbers": "12"}),
                     ToolCall("add", {"values": [1]}), ToolCall("divide", {}), ToolCall("explode", {}),
                     MalformedToolCall("{", "not JSON")])
    contents = [message["content"] for message in reply.messages]
    assert contents[0] == "3" and reply.calls == 6 and reply.errors == 5 and reply.timed_out is None
    assert contents[1].startswith("error: TypeError: numbers must be a list")
    assert contents[2].startswith("error: TypeError:") and "values" in contents[2]
    assert contents[3] == "error: LookupError: unknown tool 'divide'; tools: add, explode"
    assert contents[4] == "error: RuntimeError: boom" and "malformed tool call: not JSON" in contents[5]


def test_the_toolbox_cuts_long_replies_and_bounds_calls_per_turn():
    def flood() -> str:
        """Ten million characters."""
        return "x" * 10_000_000

    reply = ToolBox((flood,), timeout=5, max_chars=100, max_calls=3).run([ToolCall("flood", {})] * 1000)
    assert reply.calls == 3 and reply.truncated == 3 and reply.over_limit == 997
    assert all(len(message["content"]) < 200 for message in reply.messages) and len(reply.messages) == 4
    assert reply.messages[-1]["content"] == "error: at most 3 tool calls per turn; 997 not run"


def test_a_call_past_its_timeout_is_reported_and_the_rest_of_the_turn_is_not_run():
    release = threading.Event()

    def hang() -> str:
        """Wait for the test to end."""
        release.wait(60)
        return "late"

    try:
        reply = ToolBox((hang, add), timeout=0.5, max_chars=100, max_calls=8).run(
            [ToolCall("add", {"numbers": [1]}), ToolCall("hang", {}), ToolCall("add", {"numbers": [2]})])
    finally:
        release.set()
    assert isinstance(reply.timed_out, CallTimeout) and "did not return within 0.5 s" in str(reply.timed_out)
    assert [message["content"] for message in reply.messages] == ["1"]


def test_call_with_timeout_returns_or_raises_what_the_call_did():
    assert call_with_timeout(sum, 5, [1, 2]) == 3
    with pytest.raises(ZeroDivisionError):
        call_with_timeout(lambda: 1 / 0, 5)
