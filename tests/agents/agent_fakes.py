"""Fakes for the episode runner's tests: a chat tokenizer whose decode→encode round trip is not the identity, a
scripted policy that samples character by character (ids the tokenizer's own encoding never produces), and a model
over that tokenizer that samples such ids through a real rollout engine."""

from __future__ import annotations

import re
import string
import threading
from collections.abc import Callable

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

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


DRIFT_LOGITS = {"a": 2.0, "d": 2.0, "<eos>": 1.5}
"""The drift model's next-token logits, whatever the context (every other token's: :data:`OTHER_LOGIT`): turns of
about five tokens, mostly ``a`` and ``d``, which the tokenizer merges (``ad``, ``add``) when their text is encoded."""
OTHER_LOGIT = -4.0


def drift_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """A Qwen2 (the bundled tiny_adder's shapes, one layer, fp32: vLLM builds it too) over ``tokenizer`` whose
    next-token distribution is the same after any context: ``softmax`` of :data:`DRIFT_LOGITS`. Every embedding is
    the ones vector and the layer adds nothing (its output projections are zero), so the final norm hands the head
    the ones vector, and each head row is its token's logit spread evenly over the hidden size."""
    hidden = 128
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    logits = _drift_logits(tokenizer)
    with torch.no_grad():
        model.get_input_embeddings().weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(logits[:, None].expand(-1, hidden) / hidden)
    return model


def drift_logprobs(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """The drift model's log-probability of each token id (the final norm's epsilon scales the logits)."""
    return torch.log_softmax(_drift_logits(tokenizer) / (1 + 1e-6) ** 0.5, dim=0)


def _drift_logits(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    logits = torch.full((len(tokenizer),), OTHER_LOGIT)
    for token, logit in DRIFT_LOGITS.items():
        logits[tokenizer.convert_tokens_to_ids(token)] = logit
    return logits


def conversation(text: str) -> list[tuple[str, str]]:
    """(role, content) of each message of a rendered conversation (the template above, its turns closed by <eos>
    or another closing: ``[end]``)."""
    return [(role, re.sub(r"(?:<eos>|\[end\]|\n)+$", "", content))
            for role, content in re.findall(r"<\|(\w+)\|>(.*?)(?=<\|\w+\|>|$)", text, flags=re.DOTALL)]


class ScriptedPolicy:
    """``generate`` for the runner: ``respond(messages)`` (the conversation so far as (role, content) pairs) gives
    each episode's next turn as text, sampled one character per token and closed with <eos>; each token's log-prob
    is -(its position + 1)/100 and its version the call's index. ``on_call(index, prompts)`` runs before each
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
            samples.append(Sample(ids, [-(k + 1) / 100 for k in range(len(ids))], [self.calls] * len(ids)))
            self.samples.append((prompt, samples[-1]))
        self.calls += 1
        return samples
