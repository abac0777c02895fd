"""Supervised fine-tuning tensors for (prompt, completion) pairs, in the rollout layout."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase


def completion_tensors(
    tokenizer: PreTrainedTokenizerBase, pairs: list[tuple[str, str]], append_eos: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on the prompt and padding).

    Row tokens are ``tokenizer(prompt)`` + ``tokenizer(completion, add_special_tokens=False)`` (+ EOS): the
    same tokens :func:`flowkit.llm.packing.encode_pairs` gives RL and flow pretraining, so what a model is
    fine-tuned on is exactly what it later generates and is scored on.
    """
    rows = []
    for prompt, completion in pairs:
        prompt_ids = tokenizer(prompt)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids + completion_ids + ([tokenizer.eos_token_id] if append_eos else []), len(prompt_ids)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for row, (ids, prompt_len) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
    return input_ids, attention_mask, labels
