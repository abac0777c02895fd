"""A round's flow training data (seed 000 §3.2, Eq. 3) and the flow's training on it.

The data are the explanations at least one proxy accepted (rejection sampling), each with its frozen-backbone
context (the last layer's K/V only, see :func:`flowkit.explain.context.encode_context`) and every proxy's
target z1 = softmax over the decisions. When a round's generation is sharded over ranks, each rank builds the
data of its own explanations and :func:`gather_flow_data` joins them, so that every rank's flow trains on the
union with the same steps: the flow's updates are identical on every rank and equal to one rank's over the
whole round, whatever the strategy does with the gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from flowkit.distributed import all_gather_rows
from flowkit.explain.context import ContextEncoding
from flowkit.explain.reward_model import ExplanationInputs, ExplanationFlowModel


@dataclass
class FlowData:
    """R explanations, each accepted by at least one proxy (row-major, so that ranks' data join along dim 0)."""

    context: ContextEncoding  # what φ reads of each explanation: [R, Hkv, N, dh] K/V, lengths [R]
    targets: Tensor  # [R, K_p, |A|] every proxy's softmax over the decisions (z1 of Eq. 3)
    kept: Tensor  # [R, K_p] bool: proxy k's argmax is the true decision
    row_ids: Tensor  # [R] each explanation's place in the whole round, which orders the pairs

    def pairs(self) -> tuple[Tensor, Tensor]:
        """(row, proxy) indices of the accepted pairs, the flow's training examples, ordered by (``row_ids``,
        proxy): the same sequence whichever ranks the rows came from."""
        order = self.row_ids.argsort()
        row, proxy = self.kept[order].nonzero(as_tuple=True)
        return order[row], proxy


def accepted_flow_data(reward_model: ExplanationFlowModel, backbone, inputs: ExplanationInputs, targets: Tensor,
                       kept: Tensor, row_ids: Tensor) -> FlowData:
    """The flow data of one rank's explanations: ``targets`` [K_p, B, |A|] and ``kept`` [K_p, B] from the
    proxies, ``row_ids`` [B] the explanations' places in the round. Only the explanations some proxy accepted
    go through the backbone."""
    accepted = kept.any(0).nonzero().flatten()
    # Under ZeRO-3 every backbone pass is a collective: a rank that accepted nothing still encodes one
    # explanation, and keeps none of it.
    encoded = accepted if len(accepted) else torch.zeros(1, dtype=torch.long, device=kept.device)
    context = reward_model.encode(backbone, inputs.input_ids[encoded], inputs.attention_mask[encoded])
    if not len(accepted):
        context = context.select(accepted)
    return FlowData(context, targets[:, accepted].transpose(0, 1), kept[:, accepted].T,
                    row_ids[accepted.to(row_ids.device)].to(kept.device))


def gather_flow_data(data: FlowData) -> FlowData:
    """Every rank's :class:`FlowData` joined in rank order (a collective; ``data`` itself without a process
    group). Only the compact tensors φ trains on travel: the last layer's K/V (padded to the longest
    explanation of any rank), the final hidden states if the attention-free flow keeps them, the lengths,
    the proxies' targets and acceptances, and the row ids."""
    context = data.context
    hidden = None if context.hidden is None else all_gather_rows(context.hidden)
    return FlowData(ContextEncoding(all_gather_rows(context.keys), all_gather_rows(context.values), hidden,
                                    all_gather_rows(context.lengths), context.last_layer),
                    all_gather_rows(data.targets), all_gather_rows(data.kept), all_gather_rows(data.row_ids))


def fit_flow(reward_model: ExplanationFlowModel, data: FlowData, epochs: int, batch_size: int,
             generator: torch.Generator, step: Callable[[Tensor], None]) -> list[Tensor]:
    """Eq. 3 on the accepted (explanation, proxy) pairs of ``data``: ``epochs`` shuffled passes in batches of
    ``batch_size`` pairs; ``step(loss)`` back-propagates and steps the optimizer. The order and the (t, z0)
    draws come from ``generator``: ranks with the same data and generator state take identical steps.
    Returns the per-step losses (none when nothing was accepted)."""
    rows, proxies = data.pairs()
    losses = []
    for _ in range(epochs if len(rows) else 0):
        order = torch.randperm(len(rows), generator=generator, device=generator.device).to(rows.device)
        for chunk in order.split(batch_size):
            loss = reward_model.loss(data.context.select(rows[chunk]), data.targets[rows[chunk], proxies[chunk]],
                                     generator)
            step(loss)
            losses.append(loss.detach())
    return losses
