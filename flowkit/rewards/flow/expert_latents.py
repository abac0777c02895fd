"""The policy's tapped latents of expert (prompt, response) pairs, for offline flow pretraining; cached on CPU."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from flowkit.batch import RolloutBatch
from flowkit.distributed import zero3_sharded
from flowkit.llm.forward import forward_hidden
from flowkit.llm.latent_tap import LatentTap
from flowkit.llm.packing import encode_pairs


def expert_latents(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, tap: LatentTap, prompts: list[str],
    solutions: list[str], device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Tapped latents (P×B×S×d) and response mask of expert (prompt, solution) pairs, without gradients."""
    expert = encode_pairs(tokenizer, prompts, solutions).to(device)
    return _tapped_latents(model, tap, expert), expert.response_mask


def _tapped_latents(model: torch.nn.Module, tap: LatentTap, batch: RolloutBatch) -> Tensor:
    """The decoder runs only up to the deepest tapped block (all of it under ZeRO-3, which gathers parameters
    in the order of whole forwards)."""
    return tap.capture(lambda: forward_hidden(model, batch), stop_early=not zero3_sharded(model.parameters()))


class ExpertLatentCache:
    """:func:`expert_latents` that encodes each (prompt, solution) pair once and keeps its latents on CPU: offline
    pretraining over several epochs with a frozen backbone would otherwise re-encode every pair each epoch. A
    batch comes back in :func:`encode_pairs`' layout (prompts right-aligned to the widest, responses after them;
    zeros on padding, which the flow loss masks). It holds P × d floats per token of every pair seen, so it suits
    small backbones and datasets, not a 7B policy's."""

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, tap: LatentTap, device: torch.device):
        self.model, self.tokenizer, self.tap, self.device = model, tokenizer, tap, device
        self.rows: dict[tuple[str, str], tuple[Tensor, int]] = {}  # pair → (P×L×d latents of its tokens, prompt length)

    def __call__(self, prompts: list[str], solutions: list[str]) -> tuple[Tensor, Tensor]:
        pairs = list(zip(prompts, solutions))
        missing = list(dict.fromkeys(pair for pair in pairs if pair not in self.rows))
        if missing:
            self._encode(missing)
        prompt_width = max(self.rows[pair][1] for pair in pairs)
        response_width = max(self.rows[pair][0].shape[1] - self.rows[pair][1] for pair in pairs)
        first = self.rows[pairs[0]][0]
        latents = first.new_zeros(first.shape[0], len(pairs), prompt_width + response_width, first.shape[2])
        response_mask = torch.zeros(len(pairs), prompt_width + response_width)
        for row, pair in enumerate(pairs):
            tokens, prompt_length = self.rows[pair]
            start = prompt_width - prompt_length
            latents[:, row, start:start + tokens.shape[1]] = tokens
            response_mask[row, prompt_width:prompt_width + tokens.shape[1] - prompt_length] = 1.0
        return latents.to(self.device), response_mask.to(self.device)

    def _encode(self, pairs: list[tuple[str, str]]) -> None:
        expert = encode_pairs(self.tokenizer, [p for p, _ in pairs], [s for _, s in pairs]).to(self.device)
        latents = _tapped_latents(self.model, self.tap, expert).cpu()
        prompt_width = int((expert.response_mask.sum(0) == 0).sum())  # encode_pairs: all prompts end at this column
        for row, pair in enumerate(pairs):
            real = expert.attention_mask[row].bool().cpu()
            self.rows[pair] = (latents[:, row, real].clone(), int(real[:prompt_width].sum()))
