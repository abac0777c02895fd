"""`RolloutBatch`: the one currency passed between data, rollout, reward and loss code."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    """A batch of prompt + response sequences and everything computed about them.

    Each row is ``[left padding][prompt][response][right padding]``, S positions in all (the layout HF
    ``generate`` produces; positions come from ``attention_mask``): every response starts at the same column,
    the batch's longest prompt length. ``response_mask`` marks response tokens (including the EOS token when one
    was generated). In an agent episode's row the response is every token after the first prompt, the
    environment's among them; ``policy_mask`` then marks the tokens the policy sampled.

    Shapes: B rows, S positions, P layer percentiles, d hidden size.
    """

    input_ids: Tensor  # B×S long
    attention_mask: Tensor  # B×S long, 1 on real tokens
    response_mask: Tensor  # B×S float, 1 on response tokens
    group_ids: Tensor  # B long, rows sampled from the same prompt share an id
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)  # reference answers, one per row
    columns: dict[str, list] = field(default_factory=dict)  # the data's other fields, one value per row
    outcome_rewards: Tensor | None = None  # B float
    correct: Tensor | None = None  # B bool
    token_rewards: Tensor | None = None  # B×S float, dense (flow) rewards on response tokens
    advantages: Tensor | None = None  # B×S float
    old_logprobs: Tensor | None = None  # B×S float, logprob of token s under the sampling policy (aligned to input_ids)
    rollout_logprobs: Tensor | None = None  # B×S float, the rollout engine's own log-probs of its samples, same alignment
    policy_versions: Tensor | None = None  # B long, the policy version (optimizer steps) whose weights sampled each
    #                                        row; or B×S (partial rollouts, episodes): each token's, aligned to input_ids
    policy_mask: Tensor | None = None  # B×S float, 1 on the tokens the policy sampled (None: every response token)
    truncated: Tensor | None = None  # B bool, rows a bound cut (None: the step tells them by their EOS)
    ref_logprobs: Tensor | None = None  # B×S float, same under the frozen reference (KL only)
    entropy: Tensor | None = None  # B float, mean token entropy of the response
    token_entropy: Tensor | None = None  # B×S float, token entropies (a micro-batch's, for token-level flow metrics)
    latents: Tensor | None = None  # P×B×S×d, detached hidden states at the tapped layers
    old_values: Tensor | None = None  # B×S float, value-head estimates V(state before token s) at rollout (PPO + GAE)
    returns: Tensor | None = None  # B×S float, the value targets A + V (PPO + GAE)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(-1)

    @property
    def loss_mask(self) -> Tensor:
        """The tokens a policy loss trains on and a reward model scores: those the policy sampled (``policy_mask``;
        without one, every response token)."""
        return self.response_mask if self.policy_mask is None else self.policy_mask

    def _map(self, tensor_fn, list_fn) -> RolloutBatch:
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value = tensor_fn(f.name, value)
            elif isinstance(value, list):
                value = list_fn(value)
            elif isinstance(value, dict):
                value = {key: list_fn(column) for key, column in value.items()}
            values[f.name] = value
        return RolloutBatch(**values)

    def to(self, device: torch.device | str) -> RolloutBatch:
        return self._map(lambda _, t: t.to(device), list)

    def select(self, index: Tensor | list[int]) -> RolloutBatch:
        """Rows ``index`` (a bool mask or integer indices) of every field."""
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        rows = index.tolist()
        return self._map(
            lambda name, t: t[:, index] if name == "latents" else t[index.to(t.device)],
            lambda values: [values[i] for i in rows] if values else [],
        )

    def trimmed(self) -> RolloutBatch:
        """The rows cut after their last real token (right padding costs compute and changes nothing)."""
        length = int(self.attention_mask.any(0).nonzero().max()) + 1
        return self._map(lambda name, t: t[:, :, :length] if name == "latents" else t[:, :length] if t.dim() >= 2 else t,
                         list)

    @staticmethod
    def cat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Concatenate rows, right-padding sequences to the longest one."""
        if not batches:
            raise ValueError("RolloutBatch.cat needs at least one batch")
        length = max(b.input_ids.shape[1] for b in batches)
        values = {}
        for f in dataclasses.fields(RolloutBatch):
            parts = [getattr(b, f.name) for b in batches]
            if all(p is None for p in parts):
                values[f.name] = None
            elif isinstance(parts[0], list):
                values[f.name] = [x for p in parts for x in p]
            elif isinstance(parts[0], dict):
                values[f.name] = {key: [x for p in parts for x in p[key]] for key in parts[0]}
            elif any(p is None for p in parts):
                raise ValueError(f"RolloutBatch.cat: field {f.name!r} is set in some batches only")
            elif f.name == "latents":
                values[f.name] = torch.cat([pad_columns(p, length, dim=2) for p in parts], dim=1)
            elif parts[0].dim() >= 2:
                values[f.name] = torch.cat([pad_columns(p, length, dim=1) for p in parts], dim=0)
            else:
                values[f.name] = torch.cat(parts, dim=0)
        return RolloutBatch(**values)


def pad_columns(t: Tensor, length: int, dim: int = 1) -> Tensor:
    """Right-pad ``t`` with zeros along ``dim`` to ``length``."""
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


@dataclass(frozen=True)
class PromptAlignedRows:
    """Token sequences laid out as :class:`RolloutBatch` rows (:func:`prompt_aligned`): each one's prompt
    left-padded to the longest prompt, all after it response, right-padded; ``spans[i]`` is where sequence i sits."""

    input_ids: Tensor  # B×S long
    attention_mask: Tensor  # B×S long
    response_mask: Tensor  # B×S float, 1 after each row's prompt
    spans: list[slice]

    def place(self, values: list, dtype: torch.dtype) -> Tensor:
        """B×S of ``dtype``: row i holds ``values[i]`` (one per token of sequence i) at its span, 0 elsewhere."""
        placed = torch.zeros(self.input_ids.shape, dtype=dtype)
        for row, (span, row_values) in enumerate(zip(self.spans, values, strict=True)):
            placed[row, span] = torch.as_tensor(row_values, dtype=dtype)
        return placed


def prompt_aligned(sequences: list[list[int]], prompt_lengths: list[int], pad_id: int) -> PromptAlignedRows:
    """``sequences`` (each its prompt's ``prompt_lengths[i]`` ids, then its response's) as rows whose responses all
    start at one column, as the rollout engines lay out single-turn rows."""
    width = max(prompt_lengths)
    spans = [slice(width - prompt, width - prompt + len(ids)) for ids, prompt in zip(sequences, prompt_lengths)]
    shape = (len(sequences), max(span.stop for span in spans))
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention, response = torch.zeros(shape, dtype=torch.long), torch.zeros(shape)
    for row, (ids, span) in enumerate(zip(sequences, spans)):
        input_ids[row, span] = torch.tensor(ids, dtype=torch.long)
        attention[row, span] = 1
        response[row, width:span.stop] = 1.0
    return PromptAlignedRows(input_ids, attention, response, spans)
