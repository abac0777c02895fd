"""Packing generated tokens and (prompt, response) pairs into :class:`~flowkit.batch.RolloutBatch` layout.

Layout: each row is ``[left padding][prompt][response][right padding]`` — the layout HF ``generate``
produces (:mod:`flowkit.batch`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from flowkit.batch import RolloutBatch


def _response_mask(generated: Tensor, eos_token_id: int | None) -> Tensor:
    """1 on generated tokens up to and including the first EOS."""
    if eos_token_id is None:
        return torch.ones_like(generated, dtype=torch.float32)
    is_eos = generated == eos_token_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after_eos).float()


def pack_rollouts(tokenizer: PreTrainedTokenizerBase, encoded: dict[str, Tensor], generated: Tensor, prompts: list[str],
                  n: int, answers: list[str] | None, rollout_logprobs: Tensor | None = None) -> RolloutBatch:
    """Rows ``[left-padded prompt][response up to and including EOS][padding]``, ``n`` per prompt in prompt order, from
    the left-padded ``encoded`` prompts and the ``generated`` ids (and the sampler's log-probs of them, if any)."""
    response_mask = _response_mask(generated, tokenizer.eos_token_id)
    generated = torch.where(response_mask.bool(), generated, tokenizer.pad_token_id)
    prompt_mask = encoded["attention_mask"].repeat_interleave(n, dim=0)
    prompt_zeros = torch.zeros_like(prompt_mask, dtype=torch.float32)
    return RolloutBatch(
        input_ids=torch.cat([encoded["input_ids"].repeat_interleave(n, dim=0), generated], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        response_mask=torch.cat([prompt_zeros, response_mask], dim=1),
        group_ids=torch.arange(len(prompts), device=generated.device).repeat_interleave(n),
        prompts=[p for p in prompts for _ in range(n)],
        responses=tokenizer.batch_decode(generated, skip_special_tokens=True),
        answers=[a for a in answers for _ in range(n)] if answers is not None else [],
        rollout_logprobs=None if rollout_logprobs is None else torch.cat(
            [prompt_zeros, rollout_logprobs * response_mask], dim=1),
    )

def pack_response_rows(tokenizer: PreTrainedTokenizerBase, encoded: dict[str, Tensor],
                       rows: Iterable[tuple[list[int], list[float]]], prompts: list[str], n: int,
                       answers: list[str] | None) -> RolloutBatch:
    """:func:`pack_rollouts` of responses given row by row as (token ids, sampler log-probs) — an engine that samples
    elsewhere (vLLM, a rollout server) — right-padded into one tensor each."""
    rows = list(rows)
    width = max(1, max(len(tokens) for tokens, _ in rows))
    generated = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    sampler_logprobs = torch.zeros(generated.shape)
    for row, (tokens, logprobs) in enumerate(rows):
        generated[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        sampler_logprobs[row, :len(tokens)] = torch.tensor(logprobs)
    return pack_rollouts(tokenizer, encoded, generated, prompts, n, answers, sampler_logprobs)



def encode_pairs(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], responses: list[str], answers: list[str] | None = None,
    append_eos: bool = True,
) -> RolloutBatch:
    """Pack given (prompt, response) pairs into the same layout as :meth:`HFRolloutEngine.generate`.

    Used for expert solutions (offline flow pretraining) and for scoring existing responses.
    """
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    eos = [tokenizer.eos_token_id] if append_eos and tokenizer.eos_token_id is not None else []
    response_ids = [tokenizer(r, add_special_tokens=False)["input_ids"] + eos for r in responses]
    length = max(len(r) for r in response_ids)
    pad = tokenizer.pad_token_id
    generated = torch.tensor([r + [pad] * (length - len(r)) for r in response_ids], dtype=torch.long)
    response_mask = torch.tensor([[1.0] * len(r) + [0.0] * (length - len(r)) for r in response_ids])
    prompt_mask = encoded["attention_mask"]
    return RolloutBatch(
        input_ids=torch.cat([encoded["input_ids"], generated], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        response_mask=torch.cat([torch.zeros_like(prompt_mask, dtype=torch.float32), response_mask], dim=1),
        group_ids=torch.arange(len(prompts)),
        prompts=list(prompts),
        responses=list(responses),
        answers=list(answers) if answers is not None else [],
    )
