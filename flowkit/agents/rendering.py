"""Chat messages to token ids for a trajectory that only grows: the policy's tokens are never re-tokenized.

The first turn is the chat template's rendering of the environment's first messages with the generation prompt.
After a policy turn, the ids to append are the *delta* the template adds for the new messages: the template renders a
stand-in conversation ending in an assistant message with a sentinel content, then the new messages and the next
generation prompt; the text after the sentinel is the assistant turn's closing, the new messages and the next
assistant header. The policy's sampled stop token already is that closing when the template closes turns with it
(``<|im_end|>``, ``<eos>``); what the template writes after it — a newline, say, that the model never sampled — is
part of the delta. A template whose closing is not the stop token gets its closing from the delta.
"""

from __future__ import annotations

import threading
from typing import Any

from flowkit.agents.environment import Message
from flowkit.errors import ConfigError
from flowkit.llm.chat import format_prompt, has_chat_template

SENTINEL = "FLOWKIT_POLICY_TURN_SENTINEL"
STAND_IN = [{"role": "user", "content": "question"}, {"role": "assistant", "content": SENTINEL}]


class ChatRenderer:
    """Renders messages with ``tokenizer``'s chat template (``tools``: the tools' JSON schemas, or None) and encodes
    them; a delta without the special tokens the tokenizer adds to a whole text (a BOS mid-sequence).

    Thread-safe: episodes render from worker threads, and a fast tokenizer's encode may not run concurrently."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None):
        if not has_chat_template(tokenizer):
            raise ConfigError("agent episodes need a tokenizer with a chat_template; this one has none")
        self.tokenizer, self.tools = tokenizer, tools or None
        self._lock = threading.Lock()
        if SENTINEL not in self._render(STAND_IN + [{"role": "user", "content": "next"}], False):
            raise ConfigError("the tokenizer's chat template does not render an assistant message followed by a "
                              "user message, which multi-turn episodes need")

    def prompt(self, messages: list[Message]) -> list[int]:
        """The first turn's ids: ``messages`` and the generation prompt, encoded as flowkit's single-turn prompts are
        (:func:`~flowkit.llm.chat.format_prompt`: the tokenizer's own BOS, never two)."""
        text = format_prompt(messages, self.tokenizer, "chat", tools=self.tools)
        with self._lock:
            return self.tokenizer(text)["input_ids"]

    def delta(self, messages: list[Message], stop_id: int | None) -> list[int]:
        """The ids to append after a policy turn that ended with ``stop_id`` (None: none of the template's closing
        was sampled) for the environment's ``messages``, through the next generation prompt."""
        text = self._render(STAND_IN + messages, True)
        tail = text[text.index(SENTINEL) + len(SENTINEL):]
        closing = self.decode([stop_id], skip_special_tokens=False) if stop_id is not None else ""
        if closing and tail.startswith(closing):
            tail = tail[len(closing):]
        return self.encode(tail)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` inside a sequence: no special tokens added."""
        with self._lock:
            return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
