"""Proxy LLM scoring (seed 000 §3.1, App. C): M(a | x^g) = mean logit of decision a's tokens appended to
the proxy prompt; p = softmax over the candidates; rejection sampling keeps argmax p = true decision."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flowkit.explain.prompts import formatted_proxy_prompt


@torch.no_grad()
def decision_logits(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    decisions: Sequence[Sequence[str]] | Sequence[str],
    max_rows: int = 256,
) -> Tensor:
    """M(a | prompt) for every candidate of every prompt: ``[len(prompts), |A|]`` float32.

    ``decisions`` is one candidate list shared by all prompts or one list per prompt (same length).
    Each (prompt, candidate) pair is one row; rows of consecutive prompts are batched together, so all
    candidates of an example go through the same forward (``max_rows`` rows per forward).
    """
    if decisions and isinstance(decisions[0], str):
        decisions = [decisions] * len(prompts)
    num_candidates = {len(d) for d in decisions}
    if len(num_candidates) != 1:
        raise ValueError("every prompt needs the same number of candidate decisions")
    width = num_candidates.pop()
    rows, spans = [], []
    for prompt, candidates in zip(prompts, decisions, strict=True):
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        for candidate in candidates:
            candidate_ids = tokenizer(" " + candidate, add_special_tokens=False)["input_ids"]
            if not candidate_ids:
                raise ValueError(f"decision {candidate!r} encodes to no tokens; its mean logit is undefined")
            rows.append(prompt_ids + candidate_ids)
            spans.append((len(prompt_ids), len(prompt_ids) + len(candidate_ids)))
    per_forward = max(width, max_rows // width * width)
    device = next(model.parameters()).device
    scores = []
    for first in range(0, len(rows), per_forward):
        chunk, chunk_spans = rows[first:first + per_forward], spans[first:first + per_forward]
        length = max(len(r) for r in chunk)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([r + [pad] * (length - len(r)) for r in chunk], device=device)
        attention_mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in chunk], device=device)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        for row, (start, end) in enumerate(chunk_spans):
            # Token s is predicted by the logits at position s − 1.
            targets = input_ids[row, start:end]
            scores.append(logits[row, start - 1:end - 1].gather(-1, targets[:, None]).mean())
    return torch.stack(scores).view(len(prompts), width)


def rejection_mask(logits: Tensor, target: Tensor) -> Tensor:
    """Seed 000 §3.2: keep a sample when the proxy's argmax decision is the true one.

    ``logits`` [..., B, |A|], ``target`` [B] → bool [..., B]."""
    return logits.argmax(-1) == target


def proxy_probabilities(proxies: Sequence[tuple[PreTrainedModel, PreTrainedTokenizerBase]], contexts: Sequence[str],
                        reasonings: Sequence[str], decisions: Sequence[Sequence[str]], max_rows: int = 256,
                        prompt_formats: Sequence[str] | None = None) -> Tensor:
    """softmax_a M_k(a | x^g) for every proxy k: ``[K_p, B, |A|]`` (the flow's targets z1, §3.2).

    ``prompt_formats``: per proxy, ``chat`` (its tokenizer's chat template) or ``text``; None is text for all.
    """
    formats = prompt_formats or ["text"] * len(proxies)
    out = []
    for (model, tokenizer), prompt_format in zip(proxies, formats, strict=True):
        prompts = [formatted_proxy_prompt(c, r, tokenizer, prompt_format)
                   for c, r in zip(contexts, reasonings, strict=True)]
        out.append(decision_logits(model, tokenizer, prompts, decisions, max_rows).softmax(-1))
    return torch.stack(out)
