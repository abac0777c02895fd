"""Fakes for the episode runner's tests: a chat tokenizer whose decode→encode round trip is not the identity, and a
scripted policy that samples character by character (ids the tokenizer's own encoding never produces)."""

from __future__ import annotations

import re
import string
import threading
from collections.abc import Callable

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from flowkit.agents import Sample

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
# Merges the policy's character-level samples never use, so that encoding its decoded text gives other ids.
MERGES = [("a", "d"), ("ad", "d"), ("t", "o"), ("o", "l"), ("_", "c"), ("1", "2"), ("4", "7"), ("\"", ":"),
          ("e", "r"), ("b", "o"), ("bo", "x")]
# Each turn closes with <eos> and a newline the policy never samples (as Qwen's <|im_end|>\n): the separator the
# runner must write after the policy's stop token.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>tools: {% for tool in tools %}{{ tool.function.name }} {% endfor %}"
    "<eos>\n{% endif %}{% for message in messages %}{% if message.role not in ['user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message.role) }}{% endif %}"
    "<|{{ message.role }}|>{{ message.content }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def drift_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE tokenizer over printable ASCII with a few merges, so ``encode(decode(ids)) != ids`` for character-level
    ids (``a d d`` comes back as ``add``), and a chat template with a newline after each turn's ``<eos>``."""
    vocab = {token: index for index, token in enumerate(SPECIAL)}
    for char in sorted(set(string.printable) - set("\x0b\x0c\r")):
        vocab[char] = len(vocab)
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=MERGES, unk_token="<unk>"))
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL])
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", chat_template=TEMPLATE,
                                   clean_up_tokenization_spaces=False)


def conversation(text: str) -> list[tuple[str, str]]:
    """(role, content) of each message of a rendered conversation (the template above, its turns closed by <eos>
    or another closing: ``[end]``)."""
    return [(role, re.sub(r"(?:<eos>|\[end\]|\n)+$", "", content))
            for role, content in re.findall(r"<\|(\w+)\|>(.*?)(?=<\|\w+\|>|$)", text, flags=re.DOTALL)]


class ScriptedPolicy:
    """``generate`` for the runner: ``respond(messages)`` (the conversation so far as (role, content) pairs) gives
    each episode's next turn as text, sampled one character per token and closed with <eos>; each token's log-prob
    is -(its position + 1)/100 and the version is the call's index. ``on_call(index, prompts)`` runs before each
    call. Every sample it returned is kept in ``samples`` (with the prompt it answered)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, respond: Callable[[list[tuple[str, str]]], str],
                 on_call: Callable[[int, list[list[int]]], None] | None = None):
        self.tokenizer, self.respond, self.on_call = tokenizer, respond, on_call
        self.samples: list[tuple[list[int], Sample]] = []
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        if self.on_call is not None:
            self.on_call(self.calls, prompts)
        samples = []
        for prompt, limit in zip(prompts, max_new_tokens):
            text = self.respond(conversation(self.tokenizer.decode(prompt, skip_special_tokens=False)))
            ids = self.tokenizer.convert_tokens_to_ids(list(text)) + [self.tokenizer.eos_token_id]
            ids = ids[:limit]
            samples.append(Sample(ids, [-(k + 1) / 100 for k in range(len(ids))], self.calls))
            self.samples.append((prompt, samples[-1]))
        self.calls += 1
        return samples
