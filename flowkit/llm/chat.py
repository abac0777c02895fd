"""How a prompt record becomes the text the policy is given: the tokenizer's chat template or a plain template.

A prompt is either a string or a conversation ``[{"role": "system" | "user" | ..., "content": ...}, ...]`` (the
"conversational" format of TRL datasets). In ``chat`` format it is rendered with
``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` (a string prompt becomes one user
message); in ``text`` format a string prompt is substituted into ``prompt_template`` and used as is.
"""

from __future__ import annotations

from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from flowkit.errors import ConfigError

PromptFormat = Literal["auto", "chat", "text"]
PROMPT_FORMATS = ("auto", "chat", "text")


def is_conversation(prompt: Any) -> bool:
    """True for a non-empty list of ``{"role", "content"}`` messages."""
    return (isinstance(prompt, list) and bool(prompt)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt))


def has_chat_template(tokenizer: PreTrainedTokenizerBase | None) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def resolve_prompt_format(prompt_format: PromptFormat,
                          tokenizer: PreTrainedTokenizerBase | None) -> Literal["chat", "text"]:
    """``auto`` is ``chat`` when the tokenizer has a chat template (instruct models), else ``text``."""
    if prompt_format == "auto":
        return "chat" if has_chat_template(tokenizer) else "text"
    if prompt_format == "chat" and not has_chat_template(tokenizer):
        raise ConfigError("prompt_format 'chat' needs a tokenizer with a chat_template; this one has none "
                          "(use prompt_format 'text' with a prompt_template)")
    return prompt_format


def format_prompt(prompt: str | list[dict[str, str]], tokenizer: PreTrainedTokenizerBase | None,
                  prompt_format: Literal["chat", "text"], template: str = "{prompt}",
                  tools: list[dict[str, Any]] | None = None) -> str:
    """The policy's input text for one prompt.

    ``chat``: ``apply_chat_template(messages, add_generation_prompt=True)``, where a string prompt is the user
    message ``template`` with ``{prompt}`` replaced. The rollout engine tokenizes prompts with the tokenizer's
    special tokens, so a BOS token the template writes itself is dropped here (it would otherwise appear twice);
    the token ids are then exactly ``apply_chat_template(..., tokenize=True)``'s. ``tools``: the JSON schemas of the
    tools the model may call, for the template to describe (:mod:`flowkit.agents.tools`).
    ``text``: ``template`` with ``{prompt}`` replaced; a conversation is an error (it needs a chat template).
    """
    if prompt_format == "text":
        if is_conversation(prompt):
            raise ConfigError("a conversational prompt needs prompt_format 'chat' and a tokenizer with a chat_template")
        return template.replace("{prompt}", str(prompt))
    if is_conversation(prompt):
        messages = prompt
    else:
        messages = [{"role": "user", "content": template.replace("{prompt}", str(prompt))}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and _adds_bos(tokenizer):
        text = text[len(bos):]
    return text


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    ids = tokenizer("")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id
