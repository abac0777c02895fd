"""One RL step of the flow reward: its token rewards and its online flow loss (RLFR §3.3, Alg. 1).

:meth:`FlowReward.begin_step <flowkit.rewards.flow.reward.FlowReward.begin_step>` hands out a :class:`FlowStep`, which
owns everything of that step — the noise slots of its rows, the latents kept for the online update, the logged sums —
so nothing of one step reaches the next except through the reward model's buffer of accepted rollouts. What a step
reads of its reward model is :class:`StepReward`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor
from torch.distributed import ReduceOp

from flowkit.batch import RolloutBatch
from flowkit.distributed import all_reduce_int
from flowkit.rewards.flow.matching import LossPiece, scored_token_mask
from flowkit.rewards.flow.options import LatentOptions, OnlineOptions
from flowkit.rewards.flow.rejection import (
    TOKEN_METRICS, RolloutLatentBuffer, accept_rollouts, entropy_quantile_weights, next_token_entropy,
)


class StepReward(Protocol):
    """What a :class:`FlowStep` reads of its reward model (:class:`~flowkit.rewards.flow.reward.FlowReward`)."""

    latents: LatentOptions
    online: OnlineOptions
    buffer: RolloutLatentBuffer

    def scored_token_counts(self, response_mask: Tensor) -> Tensor: ...

    def token_rewards(self, batch: RolloutBatch, step: int, token_offset: int = 0,
                      sums: dict[str, Tensor] | None = None) -> Tensor: ...

    def online_losses(self, latents: Tensor, mask: Tensor, step: int,
                      token_weights: Tensor | None = None) -> list[LossPiece]: ...

    def agreed_over_ranks(self, pieces: list[LossPiece]) -> list[LossPiece]: ...


class FlowStep:
    """The step scorer of a :class:`StepReward` (a :class:`~flowkit.rewards.flow.reward.FlowReward`) for RL step
    ``step`` over ``batch``.

    Row r's first noise slot is the number of scored tokens in rows < r, so rewards do not depend on the
    micro-batches (:meth:`score`); :meth:`end_step` forms the online loss of the reward's ``flow_update``.
    """

    def __init__(self, reward: StepReward, step: int, batch: RolloutBatch):
        self.reward, self.step = reward, step
        counts = reward.scored_token_counts(batch.loss_mask).long().cpu()
        self.token_offsets = [0, *torch.cumsum(counts, 0).tolist()]
        self.candidates: list[_Candidate] = []
        self.micro_batches: list[tuple[int, int]] = []  # (first row, rows) of each scored micro-batch
        self.sums: dict[str, Tensor] = {}  # on the device until metrics(): no host sync per micro-batch
        self.logged: dict[str, float] = {}

    @torch.no_grad()
    def score(self, micro: RolloutBatch, rows: Tensor) -> Tensor:
        """Eq. 10 rewards of a micro-batch of contiguous rows (the same rows get the same rewards however the step
        is split: min-max and top-k are per row, the noise is keyed by the global scored-token index); then the
        latents of the rows the online update may use are kept (:meth:`_keep_candidates`)."""
        first = int(rows[0])
        if rows.numel() != int(rows[-1]) - first + 1:
            raise ValueError("FlowReward.score needs contiguous rows of the step's batch")
        rewards = self.reward.token_rewards(micro, self.step, self.token_offsets[first], self.sums)
        self._keep_candidates(micro, first, len(self.micro_batches))
        self.micro_batches.append((first, rows.numel()))
        return rewards

    @torch.no_grad()
    def pad(self, micro: RolloutBatch) -> None:
        """A padding micro-batch (:class:`~flowkit.rewards.base.PadsScoring`): the field runs on ``micro`` as often as
        the ranks agree for a real one (ZeRO-3 gathers its weights in each call); no sums, no candidates, and it is
        not one of the step's micro-batches."""
        self.reward.token_rewards(micro, self.step)

    def _candidate_rows(self, batch: RolloutBatch) -> Tensor:
        """B bool: the rows the online update may weigh — the correct ones when only correct rows can (``correct``,
        ``both``, ``correct+token_entropy`` with ``soft_weight`` 0), else every row (an entropy metric's batch
        median is known only after the last micro-batch; a soft weight weighs rejected rows too)."""
        online = self.reward.online
        if online.rejection_metric in ("correct", "both", "correct+token_entropy") and online.soft_weight == 0:
            return batch.correct.bool()
        return torch.ones_like(batch.correct, dtype=torch.bool)

    def _keep_candidates(self, batch: RolloutBatch, first_row: int, micro_batch: int) -> None:
        """Keep, on CPU, the latents (up to the last policy token) of the rows the online update may use
        (:meth:`_candidate_rows`); everything else is dropped with the micro-batch. A fixed number of host syncs per
        micro-batch whatever its rows: one for the rows and lengths, then one copy each of their latents, masks (and
        token entropies); the per-row cuts happen on the CPU."""
        online = self.reward.online
        if not online.online_update:
            return
        mask = batch.loss_mask  # the policy's tokens: an episode's environment tokens are no flow targets
        positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
        lengths = torch.where(mask.bool(), positions, 0).amax(-1)  # 0: no response token
        keep = self._candidate_rows(batch) & (lengths > 0)
        keep_host, lengths_host = torch.stack([keep.long(), lengths]).cpu()
        index = keep_host.nonzero().flatten()
        if not len(index):
            return
        on_device = index.to(mask.device)
        latents = batch.latents[:, on_device].cpu()
        masks = mask[on_device].cpu()
        entropies = None
        metric = online.rejection_metric
        if metric in TOKEN_METRICS:
            if batch.token_entropy is None:
                raise ValueError(f"FlowReward.online.rejection_metric {metric!r} needs the rows' token entropies "
                                 "(RolloutBatch.token_entropy)")
            entropy = batch.token_entropy
            if online.entropy_of == "next":
                entropy = next_token_entropy(entropy, mask)
            entropies = entropy[on_device].float().cpu()
        for i, (row, length) in enumerate(zip(index.tolist(), lengths_host[index].tolist())):
            self.candidates.append(_Candidate(
                first_row + row, micro_batch, latents[:, i, :length].clone(), masks[i, :length].clone(),
                None if entropies is None else entropies[i, :length].clone()))

    def end_step(self, batch: RolloutBatch) -> list[LossPiece]:
        """The online flow loss of ``online.flow_update`` (:class:`~flowkit.rewards.flow.options.OnlineOptions`) as
        pieces of at most ``network.max_rows_per_piece`` field rows that sum to it; as many on every rank
        (:meth:`~flowkit.rewards.flow.reward.FlowReward.agreed_over_ranks`)."""
        candidates, self.candidates = self.candidates, []
        online = self.reward.online
        if not online.online_update:
            return []
        if online.flow_update == "micro_batch":
            return self._micro_batch_loss(batch, candidates)
        return self._buffer_loss(batch, candidates)

    def _buffer_loss(self, batch: RolloutBatch, candidates: list[_Candidate]) -> list[LossPiece]:
        """Alg. 1: the accepted rollouts join the reward's buffer; once κ are there (on every rank), eq. 4 is the
        plain mean over all their scored tokens and the buffer empties."""
        online, buffer = self.reward.online, self.reward.buffer
        accepted = accept_rollouts(online.rejection_metric, batch.correct, batch.entropy).tolist()
        for candidate in candidates:
            if accepted[candidate.row]:
                buffer.add_one(candidate.latents, candidate.mask)
        self.logged["flow/accepted_frac"] = sum(accepted) / max(1, len(accepted))
        # Under DDP / ZeRO the flow step runs collectives and ranks accept different numbers of rollouts (e.g. by
        # correctness): the smallest buffer over all ranks decides, so every rank takes or skips the step together.
        needed = 1 if online.update_every_step else online.kappa
        if all_reduce_int(len(buffer), ReduceOp.MIN) < needed:
            self.logged["flow/buffer_size"] = float(len(buffer))
            return []
        latents, mask = buffer.pop(len(buffer))  # one flow step consumes every buffered rollout
        self.logged["flow/buffer_size"] = float(len(buffer))
        return self._pieces(latents, mask)

    def _micro_batch_loss(self, batch: RolloutBatch, candidates: list[_Candidate]) -> list[LossPiece]:
        """The official per-micro-batch masked mean (``ppo_trainer.py`` L491-505), summed over the step's micro-batches
        and divided by their number: token j of row r in micro-batch m weighs
        a_rj / Σ_j a_rj · b_r / Σ_{r∈m} b_r / M (each 0/0 read as 0)."""
        online, condition = self.reward.online, self.reward.latents.condition
        accepted = accept_rollouts(online.rejection_metric, batch.correct, batch.entropy)
        row_weights = torch.where(accepted, 1.0, online.soft_weight).float().cpu()
        self.logged["flow/accepted_frac"] = float(accepted.float().mean()) if len(accepted) else 0.0
        weighted = [c for c in candidates if row_weights[c.row] > 0]
        if all_reduce_int(len(weighted), ReduceOp.MAX) == 0:  # no rank has a weighted row: no flow step
            return []
        if not weighted:
            return self._pieces(None, None)
        micro_totals = [float(row_weights[first:first + count].sum()) for first, count in self.micro_batches]
        packing = RolloutLatentBuffer()
        token_weights, kept_fracs = [], []
        for candidate in weighted:
            packing.add_one(candidate.latents, candidate.mask)
            scored = scored_token_mask(candidate.mask[None], condition)[0]
            if candidate.entropy is None:
                tokens = scored.float()
            else:
                tokens = entropy_quantile_weights(candidate.entropy, scored, online.entropy_quantile,
                                                  online.soft_weight)
                kept_fracs.append(float(tokens.sum() / scored.sum().clamp(min=1)))
            share = float(row_weights[candidate.row]) / micro_totals[candidate.micro_batch] / len(self.micro_batches)
            token_weights.append(tokens * (share / float(tokens.sum())) if tokens.sum() > 0 else tokens)
        if kept_fracs:
            self.logged["flow/token_weight_frac"] = sum(kept_fracs) / len(kept_fracs)
        latents, mask = packing.pop(len(packing))
        weights = torch.zeros(mask.shape)
        for i, tokens in enumerate(token_weights):
            weights[i, :len(tokens)] = tokens
        return self._pieces(latents, mask, weights)

    def _pieces(self, latents: Tensor | None, mask: Tensor | None, weights: Tensor | None = None) -> list[LossPiece]:
        """Eq. 4 on ``latents`` (None: this rank has no row but others do) in logged pieces, padded to as many as
        on every rank."""
        pieces = [] if latents is None else self.reward.online_losses(latents, mask, self.step, weights)
        self.logged["flow/loss"] = 0.0
        return self.reward.agreed_over_ranks([self._logged(piece, "flow/loss") for piece in pieces])

    def _logged(self, piece: LossPiece, name: str) -> LossPiece:
        def loss() -> Tensor:
            value = piece()
            self.logged[name] = self.logged.get(name, 0.0) + float(value.detach())
            return value
        return loss

    def metrics(self) -> dict[str, float]:
        """The step's mean deviation, reward and nonzero fraction over its scored tokens, and what its online update
        logged (``flow/loss`` NaN on a step without a flow update)."""
        sums = {key: float(value) for key, value in self.sums.items()}  # the step's one host sync for them
        scored = max(1.0, sums.get("scored", 0.0))
        return {"flow/deviation_mean": sums.get("deviation", 0.0) / scored,
                "flow/reward_mean": sums.get("reward", 0.0) / scored,
                "flow/reward_nonzero_frac": sums.get("nonzero", 0.0) / scored,
                "flow/loss": float("nan"),
                **self.logged}


class _Candidate:
    """A row the online update may use: its step row and micro-batch, latents P×S_i×d, mask S_i and token
    entropies S_i (token-level metrics), on CPU."""

    __slots__ = ("row", "micro_batch", "latents", "mask", "entropy")

    def __init__(self, row: int, micro_batch: int, latents: Tensor, mask: Tensor, entropy: Tensor | None):
        self.row, self.micro_batch, self.latents, self.mask, self.entropy = row, micro_batch, latents, mask, entropy
