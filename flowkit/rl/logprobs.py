"""Token log-probabilities and entropies aligned with ``input_ids``.

:func:`token_logprobs` / :func:`token_entropy` read full B×S×V logits (the reference computation).
:func:`lm_head_logprobs` is what training uses: it never builds full-vocabulary logits (see there).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import Tensor

from flowkit.distributed import agreed_call_count, gathered, zero3_sharded

# Response tokens per LM-head chunk: 1024 tokens × 152k vocab × 4 bytes ≈ 0.6 GB of float32 logits at a time.
DEFAULT_LM_HEAD_CHUNK = 1024


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """B×S: position s holds log p(input_ids[s] | tokens < s); position 0 is 0."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """B×S entropy of the distribution that produced token s (aligned like :func:`token_logprobs`)."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(entropy, (1, 0))


def _frozen_sharded(lm_head: Callable[[Tensor], Tensor]) -> bool:
    """A ZeRO-3-sharded head that does not train (a LoRA policy's): DeepSpeed gathers a module's shards for the
    backward only when they are trained, so a checkpointed chunk recomputed in the backward would find it empty."""
    if not isinstance(lm_head, torch.nn.Linear):
        return False
    params = list(lm_head.parameters())
    return not any(p.requires_grad for p in params) and zero3_sharded(params)


class _FrozenHeadChunk(torch.autograd.Function):
    """log p(target) and the entropy of N tokens through a frozen Linear head, saving only the N×d hidden states (as
    checkpointing would): forward and backward each gather the head's weights explicitly (a collective that every rank
    runs as often, chunk counts being agreed) and recompute the chunk's logits; the gradient w.r.t. the hidden states is
    ((onehot(target) − softmax) · g / T) · W, plus −p ⊙ (log p + H) · g_H / T · W for an ``entropy_gradient``."""

    @staticmethod
    def forward(ctx, hidden: Tensor, lm_head: torch.nn.Linear, targets: Tensor, temperature: float,
                entropy_gradient: bool = False):
        ctx.save_for_backward(hidden, targets)
        ctx.lm_head, ctx.temperature, ctx.entropy_gradient = lm_head, temperature, entropy_gradient
        with torch.no_grad(), gathered(list(lm_head.parameters())):
            picked, entropy = _chunk_logprobs(lm_head.forward, hidden, targets, temperature)
        if not entropy_gradient:
            ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked: Tensor, grad_entropy: Tensor):
        hidden, targets = ctx.saved_tensors
        head = ctx.lm_head
        with torch.no_grad(), gathered(list(head.parameters())):
            logits = torch.nn.functional.linear(hidden, head.weight, head.bias).float() / ctx.temperature
            probs = torch.softmax(logits, dim=-1)
            grad_logits = -probs
            grad_logits[torch.arange(len(targets), device=targets.device), targets] += 1.0
            grad_logits *= grad_picked[:, None]
            if ctx.entropy_gradient:  # ∂H/∂z = −p ⊙ (log p + H)
                log_probs = torch.log_softmax(logits, dim=-1)
                entropy = -(probs * log_probs).sum(-1, keepdim=True)
                grad_logits -= probs * (log_probs + entropy) * grad_entropy[:, None]
            grad_hidden = (grad_logits / ctx.temperature @ head.weight.float()).to(hidden.dtype)
        return grad_hidden, None, None, None, None


def _chunk_logprobs(lm_head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor,
                    temperature: float, entropy_gradient: bool = False) -> tuple[Tensor, Tensor]:
    """log p(target) (with gradient) and the entropy (with gradient only if ``entropy_gradient``) of N tokens from
    their N×d hidden states."""
    logits = lm_head(hidden).float() / temperature
    log_normalizer = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets[:, None]).squeeze(-1) - log_normalizer
    with torch.set_grad_enabled(entropy_gradient and torch.is_grad_enabled()):
        entropy = log_normalizer - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return picked, entropy


def lm_head_logprobs(
    hidden: Tensor,
    lm_head: Callable[[Tensor], Tensor],
    input_ids: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_LM_HEAD_CHUNK,
    entropy_gradient: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of the response tokens from the last hidden state, in chunks of tokens.

    Equal to :func:`token_logprobs` / :func:`token_entropy` of ``lm_head(hidden)`` on response positions (0
    elsewhere), but only response positions go through the LM head, ``chunk_size`` tokens at a time; each chunk
    is wrapped in (non-reentrant) activation checkpointing when a gradient is needed, so neither the forward
    nor the backward ever holds more than one chunk of vocabulary-sized logits. ``lm_head`` is *called* (it is
    the module, not its weight), so tied embeddings, LoRA-wrapped heads and ZeRO-3 (which gathers parameters in
    module forward hooks, again during the recomputation) all work.

    Args:
        hidden: B×S×d last hidden state; position s−1 predicts ``input_ids[:, s]``.
        lm_head: the output-embedding module (``model.get_output_embeddings()``).
        input_ids, response_mask: B×S; log-probs are computed where ``response_mask`` is 1 (never at s = 0).
        temperature: sampling temperature the log-probs refer to.
        chunk_size: tokens per LM-head call; None runs all response tokens at once.
        entropy_gradient: the entropies carry a gradient too (an entropy bonus in the loss).

    Returns:
        B×S log-probs (with gradient through ``hidden`` and the head) and B×S entropies (detached unless
        ``entropy_gradient``).
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    response = response_mask.bool().clone()
    response[:, 0] = False  # nothing predicts the first position
    rows, cols = response.nonzero(as_tuple=True)
    states, targets = hidden[rows, cols - 1], input_ids[rows, cols]
    size = max(1, len(targets)) if chunk_size is None else chunk_size
    checkpointed = torch.is_grad_enabled() and states.requires_grad

    frozen_sharded = _frozen_sharded(lm_head)

    def head(chunk_states: Tensor, chunk_targets: Tensor) -> tuple[Tensor, Tensor]:
        if frozen_sharded:
            return _FrozenHeadChunk.apply(chunk_states, lm_head, chunk_targets, temperature, entropy_gradient)
        if checkpointed:
            return torch.utils.checkpoint.checkpoint(_chunk_logprobs, lm_head, chunk_states, chunk_targets, temperature,
                                                     entropy_gradient, use_reentrant=False)
        return _chunk_logprobs(lm_head, chunk_states, chunk_targets, temperature, entropy_gradient)

    chunks = [slice(start, start + size) for start in range(0, len(targets), size)]
    # Ranks with fewer response tokens call a ZeRO-3-sharded head as often as the rank with the most (agreed before
    # the first call: see agreed_call_count), on one dummy token whose log-prob joins the result × 0, so its backward
    # runs too.
    calls = agreed_call_count(len(chunks), lm_head) if isinstance(lm_head, torch.nn.Module) else len(chunks)
    picked, entropy = [], []
    for chunk in chunks:
        lp, ent = head(states[chunk], targets[chunk])
        picked.append(lp)
        entropy.append(ent)
    logprobs = hidden.new_zeros(response.shape, dtype=torch.float32)
    entropies = torch.zeros_like(logprobs)
    if picked:
        logprobs = logprobs.index_put((rows, cols), torch.cat(picked))
        entropies = entropies.index_put((rows, cols), torch.cat(entropy))
    for _ in range(calls - len(chunks)):
        logprobs = logprobs + head(hidden[:1, 0], input_ids[:1, 0])[0].sum() * 0.0
    return logprobs, entropies
