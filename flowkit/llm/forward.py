"""Forwards over a :class:`~flowkit.batch.RolloutBatch`, positioned as during generation.

Layout: each row is ``[left padding][prompt][response][right padding]`` — the layout HF ``generate``
produces (:mod:`flowkit.batch`). Positions are derived from the attention mask (see :func:`position_ids`), so a
forward over a batch gives the same logits as the generation did.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowkit.batch import RolloutBatch


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_logits(model: torch.nn.Module, batch: RolloutBatch) -> Tensor:
    """Logits of ``model`` over the batch's sequences, positioned as during generation."""
    return model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids(batch.attention_mask)
    ).logits


def forward_hidden(model: torch.nn.Module, batch: RolloutBatch) -> Tensor:
    """Last hidden state (B×S×d) of a causal LM over the batch, positioned as during generation, without
    the LM head: callers put only the positions they need through ``model.get_output_embeddings()`` (see
    :func:`flowkit.rl.logprobs.lm_head_logprobs`). Works through PEFT wrappers, whose injected LoRA layers
    live inside the decoder. Assumes logits = lm_head(hidden) (true of Llama / Qwen / Mistral-style models;
    not of models that soft-cap or rescale logits after the head)."""
    return model.get_decoder()(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids(batch.attention_mask)
    ).last_hidden_state
