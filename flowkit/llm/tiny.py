"""Tiny Qwen2-architecture models and character-level tokenizers, built offline for tests and toy tasks."""

from __future__ import annotations

import re
from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


def char_tokenizer(alphabet: Iterable[str], add_bos: bool = False) -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer with one token per character of ``alphabet`` plus pad/bos/eos/unk.

    Characters are split individually, so decoding ``tokenizer.decode(tokenizer.encode(s))`` returns ``s``
    for any ``s`` over the alphabet (spaces included if listed). With ``add_bos`` the tokenizer prepends
    ``<bos>`` itself and pads on the left, so ``tokenizer(prompt)`` is a complete generation prompt.
    """
    chars = sorted(set(alphabet))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        clean_up_tokenization_spaces=False, padding_side="left" if add_bos else "right",
    )


def tiny_qwen2(
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_positions: int = 512,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM (≈1 M parameters at the defaults, tied embeddings)."""
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_positions, tie_word_embeddings=True, pad_token_id=pad_token_id,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id,
    )
    return Qwen2ForCausalLM(config)


CHAT_ROLES = ("system", "user", "assistant", "tool")
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
# <bos>, a system line naming the tools (a ~1 M-parameter model cannot read their JSON schemas), then each message as
# <|role|>content<eos>; the policy's turn opens with <|assistant|> and ends with the <eos> it samples.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>tools: {{ tools | map(attribute='function.name') | join(', ') }}"
    "{{ eos_token }}{% endif %}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_char_tokenizer(alphabet: Iterable[str]) -> PreTrainedTokenizerFast:
    """:func:`char_tokenizer` (``<bos>`` added by the tokenizer) with a chat template (:data:`CHAT_TEMPLATE`), a
    special token per role (``<|user|>``, ...) and the Hermes tool-call tags as ordinary tokens of their own, so
    that decoding a turn without special tokens keeps them for the tool-call parser (as Qwen2.5's tokenizer does)."""
    tokenizer = char_tokenizer(alphabet, add_bos=True)
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<|{role}|>" for role in CHAT_ROLES]})
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_CALL_TAGS])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def parse_chat(text: str) -> list[tuple[str, str]]:
    """(role, content) of each message of a conversation rendered by :data:`CHAT_TEMPLATE` (special tokens kept),
    the tools' system line included; an open turn at the end comes with the text written so far."""
    return re.findall(r"<\|(system|user|assistant|tool)\|>(.*?)(?:<eos>|$)", text, flags=re.DOTALL)
