"""Per-sentence rewards from the trained flow (seed 000 §3.2, Eq. 5) in one backbone pass per explanation.

For explanation y = s^1..s^K the flow is evaluated at K + 1 prefixes — the prompt alone and the prompt
plus s^{1:k} — each from the same M draws of z0 (common random numbers: the draw noise is shared by
p_k and p_{k−1} and largely cancels in their difference), Euler-integrated to z1 ≈ softmax of the proxy
logits.
p_k(a*) is the mean over draws of z1[a*]; r(s^k) = p_k(a*) − p_{k−1}(a*). Under causal attention the
last-layer K/V of a prefix are the first entries of the full sequence's K/V, so all K + 1 prefixes read
one :func:`encode_context` pass and differ only in ``prefix_lengths`` (keys [0, end_k)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from flowkit.explain.context import ContextEncoding, encode_context
from flowkit.explain.flow_net import ExplanationFlow
from flowkit.explain.rectified_flow import euler_sample, noise
from flowkit.explain.sentences import sentence_spans


def sentence_token_ends(tokenizer: PreTrainedTokenizerBase, response_ids: list[int]) -> list[int]:
    """For each sentence of the decoded response, the number of response tokens up to its end."""
    text = tokenizer.decode(response_ids, skip_special_tokens=True)
    char_ends = [len(tokenizer.decode(response_ids[: i + 1], skip_special_tokens=True))
                 for i in range(len(response_ids))]
    ends = []
    for _, char_end in sentence_spans(text):
        count = next((i + 1 for i, e in enumerate(char_ends) if e >= char_end), len(response_ids))
        if not ends or count > ends[-1]:
            ends.append(count)
    return ends


def prefix_table(prompt_lengths: Tensor, sentence_ends: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Absolute prefix lengths ``[B, K_max + 1]`` (prompt, then prompt + s^{1:k}) and a validity mask.

    Rows with fewer sentences repeat their last prefix; the mask marks the real ones.
    """
    k_max = max((len(e) for e in sentence_ends), default=0)
    lengths = torch.zeros(len(sentence_ends), k_max + 1, dtype=torch.long)
    mask = torch.zeros(len(sentence_ends), k_max + 1, dtype=torch.bool)
    for row, ends in enumerate(sentence_ends):
        prefix = [int(prompt_lengths[row])] + [int(prompt_lengths[row]) + e for e in ends]
        lengths[row] = torch.tensor(prefix + [prefix[-1]] * (k_max + 1 - len(prefix)))
        mask[row, : len(prefix)] = True
    return lengths.to(prompt_lengths.device), mask.to(prompt_lengths.device)


def flow_samples(flow: ExplanationFlow, context: ContextEncoding, prefix_lengths: Tensor, z0: Tensor,
                 num_steps: int) -> Tensor:
    """z1 draws ``[B, P, M, |A|]`` at prefixes ``prefix_lengths`` [B, P] from ``z0`` [B, P, M, |A|].

    All P·M evaluations of a row run as one flow batch against the row's single context encoding.
    """
    batch, num_prefixes, num_draws, width = z0.shape
    prefixes = prefix_lengths[:, :, None].expand(-1, -1, num_draws).reshape(batch, -1)

    def velocity(t: Tensor, z: Tensor) -> Tensor:
        return flow(t, z, context, prefixes)

    z1 = euler_sample(velocity, z0.reshape(batch, num_prefixes * num_draws, width), num_steps)
    return z1.view(batch, num_prefixes, num_draws, width)


@dataclass
class SentenceRewards:
    probs: Tensor  # [B, K_max + 1] mean z1[a*] at each prefix (prefix 0 = prompt only)
    rewards: Tensor  # [B, K_max] p_k − p_{k−1}, 0 on padded sentences
    mask: Tensor  # [B, K_max] real sentences
    predicted: Tensor  # [B] argmax of the mean z1 after the whole explanation
    true_logit_mean: Tensor  # [B] mean over draws of z1[a*] after the whole explanation (the reward)
    true_logit_std: Tensor  # [B] its std over draws


def sentence_rewards_from_probs(probs: Tensor, prefix_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 5: r(s^k) = p_k − p_{k−1} on real sentences; returns (rewards, sentence mask)."""
    mask = prefix_mask[:, 1:]
    return (probs[:, 1:] - probs[:, :-1]) * mask, mask


def flow_sentence_rewards(flow: ExplanationFlow, context: ContextEncoding, prefix_lengths: Tensor,
                          prefix_mask: Tensor, decisions: Tensor, num_draws: int, num_steps: int,
                          sigma: float = 1.0, generator: torch.Generator | None = None,
                          z0: Tensor | None = None) -> SentenceRewards:
    """Sentence rewards of every row from one context encoding per row (see module docstring).

    ``z0`` [B, P, M, |A|] overrides the draws; by default one set of M draws per row serves all its prefixes.
    """
    batch, num_prefixes = prefix_lengths.shape
    if z0 is None:
        z0 = sigma * noise(torch.randn, (batch, 1, num_draws, flow.num_decisions), generator, prefix_lengths.device)
        z0 = z0.expand(-1, num_prefixes, -1, -1)
    z1 = flow_samples(flow, context, prefix_lengths, z0, num_steps)
    true = z1.gather(-1, decisions.view(-1, 1, 1, 1).expand(-1, num_prefixes, z1.shape[2], 1)).squeeze(-1)
    probs = true.mean(-1)
    rewards, mask = sentence_rewards_from_probs(probs, prefix_mask)
    last = prefix_mask.sum(-1) - 1
    rows = torch.arange(batch, device=z1.device)
    return SentenceRewards(probs=probs, rewards=rewards, mask=mask, predicted=z1[rows, last].mean(1).argmax(-1),
                           true_logit_mean=true[rows, last].mean(-1), true_logit_std=true[rows, last].std(-1))


def flow_samples_per_prefix(flow: ExplanationFlow, backbone, input_ids: Tensor, attention_mask: Tensor,
                            prefix_lengths: Tensor, z0: Tensor, num_steps: int) -> Tensor:
    """The naive path: one backbone pass per (row, prefix) over the truncated sequence. Same output as
    :func:`flow_samples` on one full pass; kept as the reference the tests and the benchmark compare to."""
    batch, num_prefixes = prefix_lengths.shape
    out = torch.empty_like(z0)
    for row in range(batch):
        for k in range(num_prefixes):
            length = int(prefix_lengths[row, k])
            context = encode_context(backbone, input_ids[row:row + 1, :length], attention_mask[row:row + 1, :length])
            out[row, k] = flow_samples(flow, context, prefix_lengths[row:row + 1, k:k + 1], z0[row:row + 1, k:k + 1],
                                       num_steps)[0, 0]
    return out
