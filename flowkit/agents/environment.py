"""The environment contract: a stateful episode the policy acts in, Gymnasium-like (as OpenEnv's), built per episode.

An environment class is registered by name (:func:`register_environment`); the runner builds one instance per
episode with no arguments and calls :meth:`Environment.reset` with the episode's data record, then
:meth:`Environment.step` with each of the policy's turns that is not a tool call, until ``done``. Messages are chat
messages (``{"role": "user", "content": "higher"}``), which the tokenizer's chat template renders. ``tools`` are plain
functions the model may call between steps (:mod:`flowkit.agents.tools`); their replies go to the model without a
``step``.

Adding an environment is one file::

    @register_environment("echo")
    class Echo:
        tools = ()

        def reset(self, record):
            return [{"role": "user", "content": record["prompt"]}]

        def step(self, action):
            return EnvStep([], reward=float(action == "ok"), done=True)

plus its import where the bundled ones are imported (:mod:`flowkit.agents.envs`), or ``module.echo`` named in
``EpisodeOptions.environment`` (the entry that importing ``module`` registers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol


Message = dict[str, str]  # {"role": ..., "content": ...}


class EnvStep(NamedTuple):
    """What the environment answers to one action, Gymnasium's way (a plain ``(messages, reward, done)`` tuple does
    too): messages for the model (none needed when ``done``), the reward of this step and whether the episode is
    over."""

    messages: list[Message]
    reward: float = 0.0
    done: bool = False


class Environment(Protocol):
    """One episode's state. Its calls may block (a sandbox, a web request): the runner runs them in worker threads
    with a timeout, and an instance is used by one episode only."""

    tools: tuple[Callable[..., Any], ...]  # plain functions with type hints and docstrings (tools.tool_schema)

    def reset(self, record: dict[str, Any]) -> list[Message]:
        """Start the episode of ``record`` (a data row): the first messages the model reads."""

    def step(self, action: str) -> EnvStep | tuple[list[Message], float, bool]:
        """The policy's turn as text (special tokens removed): the environment's answer."""


ENVIRONMENTS: dict[str, type[Environment]] = {}


def register_environment(name: str) -> Callable[[type], type]:
    """Registers the decorated environment class as ``name``."""

    def register(cls: type) -> type:
        ENVIRONMENTS[name] = cls
        return cls

    return register


def check_messages(messages: Any, source: str) -> list[Message]:
    """``messages`` if it is a list of ``{"role": str, "content": str}``, else TypeError naming ``source`` and the
    first bad entry (the episode ends: a template cannot render it)."""
    if not isinstance(messages, list):
        raise TypeError(f"{source} returned {type(messages).__name__}, not a list of messages")
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise TypeError(f"{source} returned a message that is not {{'role': str, 'content': str}}: "
                            f"{repr(message)[:200]}")
    return messages
