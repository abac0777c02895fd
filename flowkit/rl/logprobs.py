"""Token log-probabilities and entropies aligned with ``input_ids``.

:func:`token_logprobs` / :func:`token_entropy` read full B×S×V logits (the reference computation).
:func:`lm_head_logprobs` is what training uses: it never builds full-vocabulary logits (see there).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import Tensor

from flowkit.distributed import agreed_call_count
from flowkit.kernels import cpu_linear
from flowkit.kernels.logprob_entropy import logprob_entropy, logprob_entropy_backward_

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


class _LinearHeadLogprobs(torch.autograd.Function):
    """log p(target) and the entropy of N tokens through a Linear head, ``chunk`` tokens at a time, holding one chunk
    of vocabulary-sized logits at a time and saving only the N×d hidden states (as checkpointing each chunk would);
    ``chunk`` None: all N at once, their logits kept for the backward instead of recomputed (N×V floats held from the
    forward to the backward, one matmul of four saved).

    Called inside the head module's own forward (:func:`_as_forward_of`), so under ZeRO-3 DeepSpeed's module hooks
    gather the head (trained or frozen) at most once for the forward of all chunks and once for their backward (and
    keep it between the two when the module trace says it is reused next): the backward recomputes each chunk's
    logits and adds its share of every gradient under that gather. The softmax statistics and the gradient w.r.t.
    the logits (written over them) are :mod:`flowkit.kernels.logprob_entropy`'s; the hidden states get that gradient
    times W, W gets its transpose times the hidden states (summed over the chunks in fp32), the bias its column sums.
    Matmuls run in the forward's autocast dtype where autocast is on, as the module's own forward would."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, head: torch.nn.Linear, targets: Tensor,
                temperature: float, chunk: int | None, entropy_gradient: bool):
        device = hidden.device.type
        ctx.compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        ctx.kept_logits = None
        keep = chunk is None and any(ctx.needs_input_grad[:3])  # grad mode is off inside forward
        chunk = chunk or max(1, len(targets))
        ctx.head, ctx.temperature, ctx.chunk, ctx.entropy_gradient = head, temperature, chunk, entropy_gradient
        picked, entropy, normalizers = [], [], []
        for start in range(0, len(targets), chunk):
            logits = _logits(hidden[start:start + chunk], weight, bias)
            if keep:
                ctx.kept_logits = logits
            chunk_picked, chunk_entropy, log_normalizer = logprob_entropy(logits, targets[start:start + chunk],
                                                                          temperature)
            picked.append(chunk_picked)
            entropy.append(chunk_entropy)
            normalizers.append(log_normalizer)
        empty = hidden.new_zeros(0, dtype=torch.float32)
        picked, entropy, normalizers = (torch.cat(values) if values else empty.clone()
                                        for values in (picked, entropy, normalizers))
        ctx.save_for_backward(hidden, targets, normalizers, entropy)
        if not entropy_gradient:
            ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked: Tensor, grad_entropy: Tensor):
        hidden, targets, normalizers, entropies = ctx.saved_tensors
        head, dtype = ctx.head, ctx.compute_dtype
        want_weight, want_bias = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden)
        weight = head.weight.to(dtype)
        bias = None if head.bias is None else head.bias.to(dtype)
        grad_weight = None  # the first chunk's, in the layout cpu_linear returns it (a strided sum is ~4× slower)
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_bias else None
        # one buffer for every chunk's transposed copy that oneDNN multiplies (cpu_linear.grad_weight; a fresh one per
        # chunk is page-faulted in anew on CPU)
        on_cpu = want_weight and weight.device.type == "cpu"
        scratch = weight.new_empty(min(ctx.chunk, len(targets)) * min(weight.shape)) if on_cpu else None
        for start in range(0, len(targets), ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            states = hidden[rows].to(dtype)
            logits, ctx.kept_logits = ctx.kept_logits, None  # used up in place: a second backward recomputes
            if logits is None:
                logits = _logits(states, weight, bias)
            # the gradient w.r.t. the chunk's logits, written over them: the backward's largest tensor once
            grad_logits = logprob_entropy_backward_(
                logits, targets[rows], normalizers[rows], entropies[rows], grad_picked[rows],
                grad_entropy[rows] if ctx.entropy_gradient else None, ctx.temperature).to(dtype)
            grad_hidden[rows] = cpu_linear.grad_input(grad_logits, weight).to(hidden.dtype)
            if want_weight:
                part = cpu_linear.grad_weight(grad_logits, states, scratch).float()
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
            if want_bias:
                grad_bias += grad_logits.float().sum(0)
        if want_weight and grad_weight is None:  # no tokens
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_weight = None if grad_weight is None else grad_weight.to(head.weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(head.bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _logits(states: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """A chunk's contiguous fp32 logits z, a fresh tensor the caller may change in place."""
    return cpu_linear.linear(states, weight, bias).float().contiguous()  # float32 in: the same tensor


def _as_forward_of(module: torch.nn.Module, function: Callable, *args):
    """``module(*args)`` with ``function`` in place of its forward: the module's hooks — ZeRO-3's gather before its
    forward and its backward and release after them — run once around the whole of ``function``."""
    own_forward = module.__dict__.get("forward")  # an instance-level forward (e.g. accelerate's) to put back
    module.forward = function
    try:
        return module(*args)
    finally:
        if own_forward is None:
            del module.forward
        else:
            module.forward = own_forward


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
    elsewhere), but only response positions go through the LM head, ``chunk_size`` tokens at a time, and the
    backward recomputes each chunk's logits, so neither the forward nor the backward ever holds more than one chunk
    of vocabulary-sized logits (``chunk_size`` None: a Linear head keeps all of them for the backward instead).
    ``lm_head`` is *called* (it is the module, not its weight), so its module hooks run: a Linear head (tied
    embeddings included) is called once for all chunks (:class:`_LinearHeadLogprobs`), so ZeRO-3 gathers it once for
    the forward and once for the backward of the whole micro-batch; any other head (LoRA-wrapped) once per chunk,
    checkpointed (:func:`_module_head_logprobs`).

    Args:
        hidden: B×S×d last hidden state; position s−1 predicts ``input_ids[:, s]``.
        lm_head: the output-embedding module (``model.get_output_embeddings()``).
        input_ids, response_mask: B×S; log-probs are computed where ``response_mask`` is 1 (never at s = 0).
        temperature: sampling temperature the log-probs refer to.
        chunk_size: tokens per LM-head call; None runs all response tokens at once (a Linear head's backward then
            reuses the forward's logits).
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
    if isinstance(lm_head, torch.nn.Linear):
        # One call into the head per micro-batch, whatever its number of tokens: every rank makes it (ZeRO-3 gathers).
        picked, entropy = _as_forward_of(lm_head, lambda chunk_states: _LinearHeadLogprobs.apply(
            chunk_states, lm_head.weight, lm_head.bias, lm_head, targets, temperature, chunk_size, entropy_gradient),
            states)
    else:
        size = max(1, len(targets)) if chunk_size is None else chunk_size
        picked, entropy = _module_head_logprobs(lm_head, hidden, input_ids, states, targets, temperature, size,
                                                entropy_gradient)
    logprobs = hidden.new_zeros(response.shape, dtype=torch.float32).index_put((rows, cols), picked)
    entropies = torch.zeros_like(logprobs).index_put((rows, cols), entropy)
    return logprobs, entropies


def _module_head_logprobs(lm_head: Callable[[Tensor], Tensor], hidden: Tensor, input_ids: Tensor, states: Tensor,
                          targets: Tensor, temperature: float, size: int,
                          entropy_gradient: bool) -> tuple[Tensor, Tensor]:
    """Any other head (e.g. a LoRA-wrapped one): called per chunk of ``size`` tokens, each chunk in (non-reentrant)
    activation checkpointing when a gradient is needed. Under ZeRO-3 every call gathers the head (forward,
    recomputation, backward), so ranks with fewer chunks call it as often as the rank with the most (agreed before
    the first call: see agreed_call_count), on one dummy token whose log-prob joins the result × 0."""
    checkpointed = torch.is_grad_enabled() and states.requires_grad

    def head(chunk_states: Tensor, chunk_targets: Tensor) -> tuple[Tensor, Tensor]:
        if checkpointed:
            return torch.utils.checkpoint.checkpoint(_chunk_logprobs, lm_head, chunk_states, chunk_targets, temperature,
                                                     entropy_gradient, use_reentrant=False)
        return _chunk_logprobs(lm_head, chunk_states, chunk_targets, temperature, entropy_gradient)

    chunks = [slice(start, start + size) for start in range(0, len(targets), size)]
    calls = agreed_call_count(len(chunks), lm_head) if isinstance(lm_head, torch.nn.Module) else len(chunks)
    picked, entropy = [], []
    for chunk in chunks:
        lp, ent = head(states[chunk], targets[chunk])
        picked.append(lp)
        entropy.append(ent)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    picked, entropy = (torch.cat(picked) if picked else empty), (torch.cat(entropy) if entropy else empty.clone())
    for _ in range(calls - len(chunks)):
        picked = picked + head(hidden[:1, 0], input_ids[:1, 0])[0].sum() * 0.0
    return picked, entropy
