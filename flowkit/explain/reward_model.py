"""`ExplanationFlowModel`: the trainable part of the explanation reward (φ) with its training loss, logit
sampler and sentence rewards, over inputs laid out by :func:`explanation_inputs`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from flowkit.batch import RolloutBatch
from flowkit.explain.context import ContextEncoding, encode_context
from flowkit.explain.flow_net import ExplanationFlow
from flowkit.explain.rectified_flow import euler_sample, noise, rectified_flow_loss
from flowkit.explain.sentence_rewards import SentenceRewards, flow_sentence_rewards, prefix_table, sentence_token_ends


@dataclass
class ExplanationInputs:
    """Rows of (prompt + explanation) left-aligned and right-padded, as the flow's backbone pass reads them.

    ``positions[b][j]`` is where real token j of row b sits in the source :class:`RolloutBatch` (which may
    be left-padded), so rewards computed here can be placed back on the batch's tokens.
    """

    input_ids: Tensor  # [B, N]
    attention_mask: Tensor  # [B, N]
    prompt_lengths: Tensor  # [B]
    sentence_ends: list[list[int]]  # per row, response-token counts at each sentence end
    positions: list[Tensor]

    @property
    def lengths(self) -> Tensor:
        return self.attention_mask.sum(-1)


def explanation_inputs(batch: RolloutBatch, tokenizer: PreTrainedTokenizerBase) -> ExplanationInputs:
    """Left-align every row of ``batch`` and find its sentence ends (explanations with no sentence get one
    ending at their last token, so every row has K ≥ 1)."""
    rows, positions, prompt_lengths, ends = [], [], [], []
    for b in range(batch.batch_size):
        real = batch.attention_mask[b].nonzero().flatten()
        response = batch.response_mask[b, real].bool()
        rows.append(batch.input_ids[b, real])
        positions.append(real)
        prompt_lengths.append(int((~response).sum()))
        response_ids = batch.input_ids[b, real[response]].tolist()
        ends.append(sentence_token_ends(tokenizer, response_ids) or [max(len(response_ids), 1)])
    length = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), length), pad, dtype=torch.long, device=batch.input_ids.device)
    mask = torch.zeros_like(input_ids)
    for b, row in enumerate(rows):
        input_ids[b, : len(row)] = row
        mask[b, : len(row)] = 1
    return ExplanationInputs(input_ids, mask, torch.tensor(prompt_lengths, device=input_ids.device), ends, positions)


class ExplanationFlowModel(nn.Module):
    """φ plus the hyper-parameters of its use: σ of Z0, Euler steps, number of z0 draws per reward, and
    the rows per backbone pass when encoding contexts (``encode_batch_size``)."""

    def __init__(self, num_decisions: int, hidden_size: int, sigma: float = 1.0, num_steps: int = 8,
                 num_draws: int = 16, time_dim: int = 64, projector_dim: int = 256, use_attention: bool = True,
                 encode_batch_size: int = 8):
        super().__init__()
        self.sigma, self.num_steps, self.num_draws = sigma, num_steps, num_draws
        self.encode_batch_size = encode_batch_size
        self.flow = ExplanationFlow(num_decisions, hidden_size, time_dim, projector_dim, use_attention)

    def encode(self, backbone, input_ids: Tensor, attention_mask: Tensor) -> ContextEncoding:
        """:func:`encode_context` keeping the final hidden states only for the attention-free flow."""
        return encode_context(backbone, input_ids, attention_mask, self.encode_batch_size,
                              keep_hidden=not self.flow.use_attention)

    def loss(self, context: ContextEncoding, targets: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Eq. 3 on whole explanations: ``targets`` [B, |A|] = softmax of a proxy's logits per row."""
        prefixes = context.lengths[:, None]

        def velocity(t: Tensor, z: Tensor) -> Tensor:
            return self.flow(t[:, None], z[:, None], context, prefixes)[:, 0]

        return rectified_flow_loss(velocity, targets.float(), self.sigma, generator)

    @torch.no_grad()
    def predict_draws(self, context: ContextEncoding, generator: torch.Generator | None = None) -> Tensor:
        """The ``num_draws`` z1 samples after the whole explanation: ``[B, M, |A|]``."""
        batch = context.lengths.shape[0]
        prefixes = context.lengths[:, None].expand(-1, self.num_draws)
        shape = (batch, self.num_draws, self.flow.num_decisions)
        z0 = self.sigma * noise(torch.randn, shape, generator, prefixes.device)
        return euler_sample(lambda t, z: self.flow(t, z, context, prefixes), z0, self.num_steps)

    def predict(self, context: ContextEncoding, generator: torch.Generator | None = None) -> Tensor:
        """Mean over draws of z1 after the whole explanation: ``[B, |A|]``."""
        return self.predict_draws(context, generator).mean(1)

    @torch.no_grad()
    def sentence_rewards(self, backbone, inputs: ExplanationInputs, decisions: Tensor,
                         generator: torch.Generator | None = None) -> SentenceRewards:
        """Eq. 5 rewards of every sentence from one backbone pass per explanation."""
        context = self.encode(backbone, inputs.input_ids, inputs.attention_mask)
        prefixes, prefix_mask = prefix_table(inputs.prompt_lengths, inputs.sentence_ends)
        return flow_sentence_rewards(self.flow, context, prefixes, prefix_mask, decisions, self.num_draws,
                                     self.num_steps, self.sigma, generator)


def place_token_rewards(shape: tuple[int, int], inputs: ExplanationInputs, sentence_rewards: Tensor,
                        sparse: Tensor) -> Tensor:
    """Token rewards ``[B, S]`` in the source batch's layout: r(s^k) on sentence k's last token, plus the
    sparse reward (§3.2: 1 when the predicted decision is correct) on the explanation's last token."""
    out = torch.zeros(shape, device=sentence_rewards.device)
    for b, ends in enumerate(inputs.sentence_ends):
        positions = inputs.positions[b].to(out.device)
        prompt = int(inputs.prompt_lengths[b])
        for k, end in enumerate(ends):
            out[b, positions[prompt + end - 1]] += sentence_rewards[b, k]
        out[b, positions[-1]] += sparse[b]
    return out
