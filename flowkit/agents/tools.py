"""Tools: plain Python functions the model calls by name, and the parsers that find its calls in its text.

A tool is a function with type hints and a Google-style docstring (``Args:``); :func:`tool_schema` turns it into the
JSON schema that the tokenizer's chat template receives as ``tools=`` (transformers' ``get_json_schema``), so the
model sees each tool's name, purpose and arguments exactly as the function declares them. The model's turn is text;
a parser registered in :data:`TOOL_CALL_PARSERS` (:func:`register_tool_call_parser`) finds the calls in it: ``hermes``
reads the Hermes / Qwen2.5 format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

:class:`ToolBox` runs the calls and never raises: a malformed call, an unknown tool, wrong arguments or a tool that
raises become an error *observation* the model reads in the tool's reply; a reply longer than its bound is cut; a
call past its timeout is reported as :class:`CallTimeout`, which ends the episode (its thread cannot be stopped).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema

from flowkit.errors import ConfigError


class CallTimeout(Exception):
    """A tool or environment call ran past its timeout; it goes on in its daemon thread, and its episode ends."""


def call_with_timeout(fn: Callable[..., Any], timeout: float, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a daemon thread, its result or its exception re-raised here; :class:`CallTimeout`
    after ``timeout`` seconds. A daemon thread, not a pool's worker: a call that never returns must not hold a worker
    or keep the process from exiting."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True, name=f"call:{getattr(fn, '__name__', 'fn')}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CallTimeout(f"{getattr(fn, '__qualname__', fn)} did not return within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def tool_schema(tool: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``tool`` for the chat template's ``tools=``, from its type hints and docstring; a function
    without them is a one-line :class:`~flowkit.errors.ConfigError` naming it."""
    try:
        return get_json_schema(tool)
    except Exception as error:  # transformers' TypeHintParsingException / DocstringParsingException
        raise ConfigError(f"tool {getattr(tool, '__name__', tool)!r} cannot be described to the model: "
                          f"{str(error).splitlines()[0]}") from None


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedToolCall:
    """Text the model meant as a call that cannot be read as one, and why (shown to the model)."""

    text: str
    reason: str


ParsedCall = ToolCall | MalformedToolCall
ToolCallParser = Callable[[str], list[ParsedCall]]
TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {}


def register_tool_call_parser(name: str) -> Callable[[ToolCallParser], ToolCallParser]:
    """Registers ``parse(text) -> [ToolCall | MalformedToolCall, ...]`` (in the order the model wrote them) as
    ``name``."""

    def register(parse: ToolCallParser) -> ToolCallParser:
        TOOL_CALL_PARSERS[name] = parse
        return parse

    return register


HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@register_tool_call_parser("hermes")
def parse_hermes(text: str) -> list[ParsedCall]:
    """Hermes / Qwen2.5 calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` each; a call left open
    at the end of the turn is read to the end. ``arguments`` may also be a JSON string of the object (as some models
    write it)."""
    calls: list[ParsedCall] = []
    for body in HERMES_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(MalformedToolCall(body, f"not JSON ({error.msg} at character {error.pos})"))
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            calls.append(MalformedToolCall(body, 'expected {"name": "<tool>", "arguments": {...}}'))
        else:
            calls.append(ToolCall(call["name"], arguments))
    return calls


@dataclass
class ToolReply:
    """What running one turn's calls gave: the tool messages for the model and what to count."""

    messages: list[dict[str, str]] = field(default_factory=list)
    calls: int = 0  # calls run (or answered with an error)
    errors: int = 0  # malformed calls, unknown tools, wrong arguments, tools that raised
    truncated: int = 0  # replies cut to the bound
    over_limit: int = 0  # calls past the per-turn limit, answered with one error message
    timed_out: CallTimeout | None = None  # a call that hung: the episode ends


class ToolBox:
    """The tools of one environment by name, run with bounds: ``timeout`` seconds per call, ``max_chars`` of reply
    per call, ``max_calls`` calls per turn."""

    def __init__(self, tools: tuple[Callable[..., Any], ...], timeout: float, max_chars: int, max_calls: int):
        self.tools = {tool.__name__: tool for tool in tools}
        self.schemas = [tool_schema(tool) for tool in tools]
        self.timeout, self.max_chars, self.max_calls = timeout, max_chars, max_calls

    def run(self, calls: list[ParsedCall]) -> ToolReply:
        """One tool message per call up to ``max_calls`` (then one message saying how many were not run); stops at
        the first call that times out."""
        reply = ToolReply()
        for call in calls[:self.max_calls]:
            name = call.name if isinstance(call, ToolCall) else "invalid_call"
            reply.calls += 1
            try:
                content = self._answer(call)
            except CallTimeout as timeout:
                reply.timed_out = timeout
                return reply
            except Exception as error:  # noqa: BLE001 - the model reads what went wrong
                reply.errors += 1
                content = f"error: {type(error).__name__}: {error}"
            if len(content) > self.max_chars:
                reply.truncated += 1
                content = content[:self.max_chars] + f"... [cut: {len(content) - self.max_chars} more characters]"
            reply.messages.append({"role": "tool", "name": name, "content": content})
        if len(calls) > self.max_calls:
            reply.over_limit = len(calls) - self.max_calls
            reply.messages.append({"role": "tool", "name": "invalid_call", "content":
                                   f"error: at most {self.max_calls} tool calls per turn; {reply.over_limit} not run"})
        return reply

    def _answer(self, call: ParsedCall) -> str:
        if isinstance(call, MalformedToolCall):
            raise ValueError(f"malformed tool call: {call.reason}")
        if call.name not in self.tools:
            raise LookupError(f"unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools)) or 'none'}")
        result = call_with_timeout(self.tools[call.name], self.timeout, **call.arguments)
        return result if isinstance(result, str) else json.dumps(result, default=str)
