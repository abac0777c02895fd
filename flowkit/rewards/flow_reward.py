"""RLFR's flow reward: velocity deviation of the policy's latents under a reference flow (§3.3, Alg. 1)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.distributed import ReduceOp

from flowkit.batch import RolloutBatch
from flowkit.distributed import all_reduce_int
from flowkit.errors import ConfigError, check_nonempty, check_range
from flowkit.flow import (
    VelocityField, flow_matching_loss_pieces, padding_velocity, pretraining_loss_pieces, velocity_deviation_scores,
)
from flowkit.flow.matching import DEFAULT_MAX_ROWS, Condition, LossPiece, scored_token_mask
from flowkit.rewards.base import TokenRewardModel
from flowkit.rl.rejection import (
    METRICS, TOKEN_METRICS, Metric, RolloutLatentBuffer, accept_rollouts, entropy_quantile_weights,
)
from flowkit.rl.rewards import NORMALIZATIONS, Normalization, flow_token_rewards
from flowkit.seeding import run_seed

FlowUpdate = Literal["buffer", "micro_batch"]


def _check_rewarding_timestep(t: float) -> None:
    """A rewarding timestep must lie in (0, 1) as a float32 and give a finite float32 weight t/(1−t) (eq. 7):
    0.99999999 rounds to 1.0 in float32, where the weight is infinite and every score NaN or inf."""
    t32 = torch.tensor(t, dtype=torch.float32)
    if not (0 < t32 < 1 and torch.isfinite(t32 / (1 - t32))):
        raise ConfigError(f"FlowReward.timesteps must lie in (0, 1) with a finite t/(1−t) weight in float32, "
                          f"got {t!r} ({float(t32)!r} in float32)")


class FlowReward(TokenRewardModel):
    """Dense reward r_k = −β·𝕀[r̂_k > η]·r̂_k from the debiased deviation R_CFM (eq. 7, 10).

    Args:
        percentiles: layer percentiles P whose latents are scored: the outputs of decoder blocks
            min(round(p·L), L−1), as the official code hooks them (:func:`~flowkit.llm.latent_tap.tapped_layer_indices`).
        depth, width: velocity-field size (width defaults to the backbone's hidden size).
        timesteps: rewarding timesteps T (weights t/(1−t)); also the online update's timesteps.
        eta, beta, top_k: threshold η, scale β and optional top-k of eq. 10 (official scripts: 0.6, 0.01, 15;
            top-k keeps exactly k tokens in rows with ≥ k survivors).
        normalization: ``minmax`` (official scripts: r̂ ∈ [0, 1], penalties only), ``bilateral`` (the paper's
            eq. 10 text: r̂ ∈ [−1, 1], |r̂| > η, bonuses for unusually low deviation) or ``mean`` (official
            ``mean``: min-max minus the row mean, |r̂| > η); see :mod:`flowkit.rl.rewards`.
        condition: which latent conditions the field of token j: ``next`` = h_{j+1} (the paper's text and the
            official offline pretraining, ``token_pre``; the last response token is unscored) or ``previous`` =
            h_{j−1} (the official RL scripts, ``token_post``; the first response token is scored against the last
            prompt token; the default, as it reproduces the official runs), or ``none``. The official runs pretrain
            with ``next`` and do RL with ``previous``.
        noise_draws: noise draws averaged per reward (variance reduction; the official code uses 1).
        debias: weight each rewarding timestep's deviation by t/(1−t) (eq. 7, default); False averages the plain
            R_FM of eq. 5 (the paper's "w/o debias" ablation).
        max_rows_per_call: velocity-field rows (token × percentile × timestep) per call when scoring; bounds the
            scoring memory for long rollouts without changing any score. None scores everything in one call.
        max_rows_per_piece: velocity-field rows per backward piece of the flow loss (the online update and offline
            pretraining): the pieces are backpropagated one at a time, so this bounds the field's activations held
            for a backward whatever the number and length of the rollouts (README "Memory at paper scale"); the loss
            does not change. None: one piece.
        seed: base seed of the reward noise (step s uses ``seed + 1000·s`` so rewards are reproducible) and of
            the field's initialisation, which runs on its own RNG so it never shifts the policy's sampling.
            ``None`` (default): the run's global seed (``seed_everything``); an int pins it.
        rejection_metric: which rollouts train the flow online (:mod:`flowkit.rl.rejection`): ``correct``
            (official ``batch_correct``), ``entropy`` (mean entropy above the batch median), ``both``; with
            ``flow_update: micro_batch`` also ``token_entropy`` (official ``trajectory_entropy``: every row, its
            tokens selected by ``entropy_quantile``) and ``correct+token_entropy`` (official
            ``batch_correct+trajectory_entropy``).
        kappa: a flow update happens once at least κ accepted rollouts are buffered; it uses all of them
            (the paper's Alg. 1; ``flow_update: buffer``).
        update_every_step: update the flow on every RL step that accepted any rollout, on that step's accepted
            rollouts, ignoring κ (the official code's cadence). Under several ranks a step is taken when every
            rank accepted at least one (``flow_update: buffer``).
        flow_update: how the online flow loss is formed. ``buffer`` (default) reproduces the paper's Alg. 1: the
            accepted rollouts are buffered until κ are there, then eq. 4 is the plain mean over all their scored
            tokens. ``micro_batch`` reproduces the official trainer (``ppo_trainer.py`` L488-520): every step, per
            micro-batch of the scoring pass, a masked mean — per row over its tokens weighted a_j (1, or by
            ``entropy_quantile``), then over the micro-batch's rows weighted b_r (1 if accepted, else
            ``soft_weight``) — and the step's loss is the mean of these over the rank's micro-batches (DeepSpeed's
            gradient accumulation). flowkit skips the flow step when no rank has a weighted row, where the official
            steps its optimizer on a zero gradient (Adam's momentum alone moves it), and scores a row whose token
            weights are all 0 as 0 where the official divides by 0.
        soft_weight: weight b_r of a rejected row, and a_j of a token below the entropy quantile, in the
            ``micro_batch`` loss (official ``--soft_flow``, default 0: rejected rollouts do not train the flow).
        entropy_quantile: q of the token-level selection (official ``--metrics_entropy_quantile``): in each row,
            tokens whose entropy is ≥ the row's q-quantile (linear interpolation, over its scored tokens; the
            official takes it over the padded row) weigh 1, the others ``soft_weight``. Needs a ``token_entropy``
            metric.
        score_power: γ of the official ``--flow_gamma``: the normalised scores r̂ are raised to γ before the
            threshold η (sign-preserving, sign(r̂)·|r̂|^γ, for the two-sided normalisations, where the official's
            ``pow`` of a negative score is NaN for fractional γ). 1 is off.
        flow_warmup_steps: for the first N RL steps the policy is frozen (no policy backward, no policy optimizer
            step) and only the flow trains, on the policy's own rollouts (official
            ``--freezing_actor_steps_for_flow N``: its steps 1…N).
        online_update: set False to freeze the flow during RL (ablation).
        pretrain_timesteps: offline pretraining copies of every token, each with its own logit-normal t and
            noise (the official ``flow_batch_mul``: 4 for Qwen2.5-1.5B, 2 for 7B).
        pretrain_logit_mean: location m of the pretraining timesteps t = sigmoid(n), n ~ N(m, 1). The official
            code uses 0; m > 0 spends more of the pretraining near the high rewarding timesteps (SD3's
            lognorm(m, s) shift), which the tiny default uses to reach its error signal in fewer steps.
        weights: optional safetensors file of a pretrained velocity field to start from; a missing file, an unreadable
            one, or one of another depth / width / hidden size is a :class:`~flowkit.errors.ConfigError`.
    """

    def __init__(
        self,
        percentiles: Sequence[float] = (0.25, 0.5, 0.75),
        depth: int = 4,
        width: int | None = None,
        timesteps: Sequence[float] = (0.8,),
        eta: float = 0.6,
        beta: float = 0.01,
        top_k: int | None = None,
        normalization: Normalization = "minmax",
        condition: Condition = "previous",
        noise_draws: int = 1,
        debias: bool = True,
        max_rows_per_call: int | None = DEFAULT_MAX_ROWS,
        max_rows_per_piece: int | None = DEFAULT_MAX_ROWS,
        seed: int | None = None,
        rejection_metric: Metric = "correct",
        kappa: int = 32,
        update_every_step: bool = False,
        online_update: bool = True,
        flow_update: FlowUpdate = "buffer",
        soft_weight: float = 0.0,
        entropy_quantile: float | None = None,
        score_power: float = 1.0,
        flow_warmup_steps: int = 0,
        pretrain_timesteps: int = 4,
        pretrain_logit_mean: float = 0.0,
        weights: str | None = None,
    ):
        super().__init__()
        check_nonempty("FlowReward", "percentiles", percentiles)
        for p in percentiles:
            check_range("FlowReward", "percentiles", p, 0.0, 1.0, open_low=True)  # as tapped_layer_indices takes them
        check_range("FlowReward", "depth", depth, 1)
        check_range("FlowReward", "width", width, 1)
        check_nonempty("FlowReward", "timesteps", timesteps)
        for t in timesteps:
            _check_rewarding_timestep(t)
        check_range("FlowReward", "eta", eta, 0.0, 1.0)  # r̂ lies in [0, 1] (|r̂| in [0, 1] for bilateral / mean)
        check_range("FlowReward", "beta", beta, 0.0)
        check_range("FlowReward", "top_k", top_k, 1)
        check_range("FlowReward", "noise_draws", noise_draws, 1)
        check_range("FlowReward", "max_rows_per_call", max_rows_per_call, 1)
        check_range("FlowReward", "max_rows_per_piece", max_rows_per_piece, 1)
        check_range("FlowReward", "seed", seed, 0)
        check_range("FlowReward", "kappa", kappa, 1)
        check_range("FlowReward", "pretrain_timesteps", pretrain_timesteps, 1)
        check_range("FlowReward", "pretrain_logit_mean", pretrain_logit_mean, -5.0, 5.0)  # beyond, t is all 0 or 1
        _check_online_protocol(rejection_metric, flow_update, soft_weight, entropy_quantile, score_power,
                               flow_warmup_steps, update_every_step, online_update)
        if weights is not None and not Path(weights).is_file():
            raise ConfigError(f"FlowReward.weights {weights!r} is not a file")
        self.percentiles = tuple(percentiles)
        self.depth, self.width = depth, width
        self.timesteps = tuple(timesteps)
        self.eta, self.beta, self.top_k = eta, beta, top_k
        if normalization not in NORMALIZATIONS:
            raise ConfigError(f"FlowReward.normalization must be one of {', '.join(NORMALIZATIONS)}, got {normalization!r}")
        self.normalization: Normalization = normalization
        self.condition: Condition = condition
        self.noise_draws, self.seed = noise_draws, run_seed(seed)
        self.debias = debias
        self.max_rows_per_call, self.max_rows_per_piece = max_rows_per_call, max_rows_per_piece
        self.rejection_metric: Metric = rejection_metric
        self.kappa, self.update_every_step, self.online_update = kappa, update_every_step, online_update
        self.flow_update: FlowUpdate = flow_update
        self.soft_weight, self.entropy_quantile, self.score_power = soft_weight, entropy_quantile, score_power
        self.flow_warmup_steps = flow_warmup_steps
        self.pretrain_timesteps, self.pretrain_logit_mean = pretrain_timesteps, pretrain_logit_mean
        self.weights = weights
        self.field: VelocityField | None = None
        self.layer_positions: tuple[float, ...] = ()
        self.buffer = RolloutLatentBuffer()
        self._candidates: list[_Candidate] = []
        self._micro_batches: list[tuple[int, int]] = []  # (first row, rows) of each scored micro-batch of the step
        self._step, self._token_offsets = 0, [0]
        self._sums: dict[str, Tensor] = {}
        self._metrics: dict[str, float] = {}

    def bind(self, backbone: torch.nn.Module, layer_positions: Sequence[float], tokenizer=None) -> None:
        """Build the velocity field for the backbone: width d, RMSNorm ε = the backbone's ``rms_norm_eps`` (official).

        The initialisation draws from a generator seeded with ``seed`` inside a forked RNG, so binding a flow
        reward leaves the global RNG (the policy's sampling stream) exactly where it was.
        """
        self.layer_positions = tuple(layer_positions)
        config = backbone.config
        eps = getattr(config, "rms_norm_eps", None) or 1e-6
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.field = VelocityField(config.hidden_size, self.width, self.depth, conditioned=self.condition != "none",
                                       norm_eps=eps)
        if self.weights:
            self.load_field(self.weights)

    def _require_field(self) -> VelocityField:
        if self.field is None:
            raise RuntimeError("FlowReward.bind(backbone, layer_positions) must be called before use")
        return self.field

    def deviation_scores(self, latents: Tensor, response_mask: Tensor, seed: int, token_offset: int = 0) -> Tensor:
        """R_CFM per token (B×S, zero where unscored) for latents P×B×S×d; ``token_offset`` keys the noise of
        a micro-batch by its global scored-token index (see :meth:`scored_token_counts`)."""
        return velocity_deviation_scores(
            self._require_field(), latents, response_mask, self.layer_positions, self.timesteps, seed,
            self.condition, self.noise_draws, self.max_rows_per_call, token_offset, self.debias,
        )

    def scored_token_counts(self, response_mask: Tensor) -> Tensor:
        """B: how many tokens of each row are scored (each a noise slot)."""
        return scored_token_mask(response_mask, self.condition).sum(-1)

    def begin_step(self, step: int, batch: RolloutBatch) -> None:
        """Row r's first noise slot is the number of scored tokens in rows < r, so rewards do not depend on the
        micro-batches; the candidates an earlier (skipped) step left are dropped."""
        self._step = step
        counts = self.scored_token_counts(batch.response_mask).long().cpu()
        self._token_offsets = [0, *torch.cumsum(counts, 0).tolist()]
        self._candidates, self._micro_batches = [], []

    def freezes_policy(self, step: int) -> bool:
        """``flow_warmup_steps``: the first N RL steps train the flow only."""
        return step < self.flow_warmup_steps

    @torch.no_grad()
    def score(self, micro: RolloutBatch, rows: Tensor) -> Tensor:
        """Eq. 10 rewards of a micro-batch of contiguous rows (the same rows get the same rewards however the step
        is split: min-max and top-k are per row, the noise is keyed by the global scored-token index); then the
        latents of the rows the online update may use are kept (:meth:`_keep_candidates`)."""
        first = int(rows[0])
        if rows.numel() != int(rows[-1]) - first + 1:
            raise ValueError("FlowReward.score needs contiguous rows of the step's batch")
        rewards = self.token_rewards(micro, self._step, self._token_offsets[first])
        self._keep_candidates(micro, first, len(self._micro_batches))
        self._micro_batches.append((first, rows.numel()))
        return rewards

    @torch.no_grad()
    def token_rewards(self, batch: RolloutBatch, step: int, token_offset: int = 0) -> Tensor:
        """Eq. 10 rewards of ``batch``'s rows at step ``step``, whose first scored token is noise slot
        ``token_offset``. The logged sums stay on the device (float64, as Python floats add) until
        :meth:`step_metrics`: no host sync per micro-batch."""
        scores = self.deviation_scores(batch.latents, batch.response_mask, self.seed + 1000 * step, token_offset)
        scored = scored_token_mask(batch.response_mask, self.condition)
        rewards = flow_token_rewards(scores, scored, self.eta, self.beta, self.top_k, self.normalization,
                                     self.score_power)
        for key, value in {"deviation": scores[scored].sum(), "reward": rewards[scored].sum(),
                           "nonzero": (rewards[scored] != 0).sum(), "scored": scored.sum()}.items():
            value = value.double()
            self._sums[key] = self._sums[key] + value if key in self._sums else value
        return rewards

    def _candidate_rows(self, batch: RolloutBatch) -> Tensor:
        """B bool: the rows the online update may weigh — the correct ones when only correct rows can (``correct``,
        ``both``, ``correct+token_entropy`` with ``soft_weight`` 0), else every row (an entropy metric's batch
        median is known only after the last micro-batch; a soft weight weighs rejected rows too)."""
        if self.rejection_metric in ("correct", "both", "correct+token_entropy") and self.soft_weight == 0:
            return batch.correct.bool()
        return torch.ones_like(batch.correct, dtype=torch.bool)

    def _keep_candidates(self, batch: RolloutBatch, first_row: int, micro_batch: int) -> None:
        """Keep, on CPU, the latents (up to the last response token) of the rows the online update may use
        (:meth:`_candidate_rows`); everything else is dropped with the micro-batch. A fixed number of host syncs per
        micro-batch whatever its rows: one for the rows and lengths, then one copy each of their latents, masks (and
        token entropies); the per-row cuts happen on the CPU."""
        if not self.online_update:
            return
        mask = batch.response_mask
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
        if self.rejection_metric in TOKEN_METRICS:
            if batch.token_entropy is None:
                raise ValueError(f"FlowReward.rejection_metric {self.rejection_metric!r} needs the rows' token "
                                 "entropies (RolloutBatch.token_entropy)")
            entropies = batch.token_entropy[on_device].float().cpu()
        for i, (row, length) in enumerate(zip(index.tolist(), lengths_host[index].tolist())):
            self._candidates.append(_Candidate(
                first_row + row, micro_batch, latents[:, i, :length].clone(), masks[i, :length].clone(),
                None if entropies is None else entropies[i, :length].clone()))

    def end_step(self, batch: RolloutBatch) -> list[LossPiece]:
        """The online flow loss of ``flow_update`` (see the class docstring) as pieces of at most
        ``max_rows_per_piece`` field rows that sum to it; as many on every rank (:meth:`_agreed_over_ranks`)."""
        candidates, self._candidates = self._candidates, []
        if not self.online_update:
            return []
        if self.flow_update == "micro_batch":
            return self._micro_batch_loss(batch, candidates)
        accepted = accept_rollouts(self.rejection_metric, batch.correct, batch.entropy).tolist()
        for candidate in candidates:
            if accepted[candidate.row]:
                self.buffer.add_one(candidate.latents, candidate.mask)
        self._metrics["flow/accepted_frac"] = sum(accepted) / max(1, len(accepted))
        # Under DDP / ZeRO the flow step runs collectives and ranks accept different numbers of rollouts (e.g. by
        # correctness): the smallest buffer over all ranks decides, so every rank takes or skips the step together.
        needed = 1 if self.update_every_step else self.kappa
        if all_reduce_int(len(self.buffer), ReduceOp.MIN) < needed:
            self._metrics["flow/buffer_size"] = float(len(self.buffer))
            return []
        latents, mask = self.buffer.pop(len(self.buffer))  # one flow step consumes every buffered rollout
        self._metrics["flow/buffer_size"] = float(len(self.buffer))
        self._metrics["flow/loss"] = 0.0
        pieces = flow_matching_loss_pieces(self._require_field(), latents, mask, self.layer_positions,
                                           torch.tensor(self.timesteps), self.seed + 1000 * self._step + 1, self.condition,
                                           self.max_rows_per_piece)
        return self._agreed_over_ranks([self._logged(piece, "flow/loss") for piece in pieces])

    def _micro_batch_loss(self, batch: RolloutBatch, candidates: list[_Candidate]) -> list[LossPiece]:
        """The official per-micro-batch masked mean (``ppo_trainer.py`` L491-505), summed over the step's micro-batches
        and divided by their number: token j of row r in micro-batch m weighs
        a_rj / Σ_j a_rj · b_r / Σ_{r∈m} b_r / M (each 0/0 read as 0)."""
        accepted = accept_rollouts(self.rejection_metric, batch.correct, batch.entropy)
        row_weights = torch.where(accepted, 1.0, self.soft_weight).float().cpu()
        self._metrics["flow/accepted_frac"] = float(accepted.float().mean()) if len(accepted) else 0.0
        micro_totals = [float(row_weights[first:first + count].sum()) for first, count in self._micro_batches]
        weighted = [c for c in candidates if row_weights[c.row] > 0]
        if all_reduce_int(len(weighted), ReduceOp.MAX) == 0:  # no rank has a weighted row: no flow step
            return []
        pieces: list[LossPiece] = []
        if weighted:
            packing = RolloutLatentBuffer()
            token_weights, kept_fracs = [], []
            for candidate in weighted:
                packing.add_one(candidate.latents, candidate.mask)
                scored = scored_token_mask(candidate.mask[None], self.condition)[0]
                if candidate.entropy is None:
                    tokens = scored.float()
                else:
                    tokens = entropy_quantile_weights(candidate.entropy, scored, self.entropy_quantile,
                                                      self.soft_weight)
                    kept_fracs.append(float(tokens.sum() / scored.sum().clamp(min=1)))
                share = (float(row_weights[candidate.row]) / micro_totals[candidate.micro_batch]
                         / len(self._micro_batches))
                token_weights.append(tokens * (share / float(tokens.sum())) if tokens.sum() > 0 else tokens)
            if kept_fracs:
                self._metrics["flow/token_weight_frac"] = sum(kept_fracs) / len(kept_fracs)
            latents, mask = packing.pop(len(packing))
            weights = torch.zeros(mask.shape)
            for i, tokens in enumerate(token_weights):
                weights[i, :len(tokens)] = tokens
            pieces = flow_matching_loss_pieces(self._require_field(), latents, mask, self.layer_positions,
                                               torch.tensor(self.timesteps), self.seed + 1000 * self._step + 1,
                                               self.condition, self.max_rows_per_piece, token_weights=weights)
        self._metrics["flow/loss"] = 0.0
        return self._agreed_over_ranks([self._logged(piece, "flow/loss") for piece in pieces])

    def pretrain_losses(self, latents: Tensor, response_mask: Tensor, generator: torch.Generator) -> list[LossPiece]:
        """Offline flow pretraining (eq. 4) as the official: ``pretrain_timesteps`` copies of every token, one
        logit-normal t (location ``pretrain_logit_mean``) and one noise draw per copy, all from ``generator``; in
        pieces of at most ``max_rows_per_piece`` field rows that sum to the loss, to backpropagate one at a time."""
        pieces = pretraining_loss_pieces(self._require_field(), latents, response_mask, self.layer_positions,
                                         self.pretrain_timesteps, generator, self.condition, self.pretrain_logit_mean,
                                         self.max_rows_per_piece)
        return self._agreed_over_ranks(pieces)

    def _agreed_over_ranks(self, pieces: list[LossPiece]) -> list[LossPiece]:
        """Every rank backpropagates as many pieces as the rank with the most (each backward reduces gradients, and
        under ZeRO-3 each field call gathers weights); the extra pieces run the field on a dummy row, × 0."""
        field = self._require_field()
        padding = all_reduce_int(len(pieces), ReduceOp.MAX) - len(pieces)
        return pieces + [lambda: padding_velocity(field).sum() * 0.0] * padding

    def _logged(self, piece: LossPiece, name: str) -> LossPiece:
        def loss() -> Tensor:
            value = piece()
            self._metrics[name] = self._metrics.get(name, 0.0) + float(value.detach())
            return value
        return loss

    def step_metrics(self) -> dict[str, float]:
        sums = {key: float(value) for key, value in self._sums.items()}  # the step's one host sync for them
        self._sums = {}
        scored = max(1.0, sums.get("scored", 0.0))
        metrics = {"flow/deviation_mean": sums.get("deviation", 0.0) / scored,
                   "flow/reward_mean": sums.get("reward", 0.0) / scored,
                   "flow/reward_nonzero_frac": sums.get("nonzero", 0.0) / scored,
                   "flow/loss": float("nan"),  # NaN on steps without a flow update
                   **self._metrics}
        self._metrics = {}
        return metrics

    def save_field(self, path: str | Path) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in self._require_field().state_dict().items()}, str(path))

    def load_field(self, path: str | Path) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"flow weights {str(path)!r} do not exist")
        field = self._require_field()
        try:
            state = load_file(str(path))
        except SafetensorError as err:  # e.g. a truncated file
            raise ConfigError(f"flow weights {str(path)!r} are not a readable safetensors file ({err})") from None
        expected = field.state_dict()
        missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
        resized = sorted(k for k in expected.keys() & state.keys() if expected[k].shape != state[k].shape)
        if missing or unexpected or resized:
            first = (missing or unexpected or resized)[0]
            raise ConfigError(f"flow weights {str(path)!r} do not fit this FlowReward (depth {self.depth}, width "
                              f"{field.width}, hidden size {field.hidden_size}): {len(missing)} missing, "
                              f"{len(unexpected)} unexpected, {len(resized)} differently shaped tensors (first: {first!r})")
        field.load_state_dict(state)

    def get_extra_state(self) -> dict:
        return {"buffer": self.buffer.state_dict()}

    def set_extra_state(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])


class _Candidate:
    """A row the online update may use: its step row and micro-batch, latents P×S_i×d, mask S_i and token
    entropies S_i (token-level metrics), on CPU."""

    __slots__ = ("row", "micro_batch", "latents", "mask", "entropy")

    def __init__(self, row: int, micro_batch: int, latents: Tensor, mask: Tensor, entropy: Tensor | None):
        self.row, self.micro_batch, self.latents, self.mask, self.entropy = row, micro_batch, latents, mask, entropy


def _check_online_protocol(metric: str, flow_update: str, soft_weight: float, entropy_quantile: float | None,
                           score_power: float, flow_warmup_steps: int, update_every_step: bool,
                           online_update: bool) -> None:
    """One-line ConfigErrors for the official online protocol's options (see :class:`FlowReward`)."""
    if metric not in METRICS:
        raise ConfigError(f"FlowReward.rejection_metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if flow_update not in ("buffer", "micro_batch"):
        raise ConfigError(f"FlowReward.flow_update must be buffer or micro_batch, got {flow_update!r}")
    check_range("FlowReward", "soft_weight", soft_weight, 0.0, 1.0)
    check_range("FlowReward", "entropy_quantile", entropy_quantile, 0.0, 1.0)
    check_range("FlowReward", "score_power", score_power, 0.0, open_low=True)
    check_range("FlowReward", "flow_warmup_steps", flow_warmup_steps, 0)
    if flow_update == "buffer" and (soft_weight > 0 or metric in TOKEN_METRICS):
        raise ConfigError("FlowReward.soft_weight > 0 and the token_entropy metrics weigh tokens of the official "
                          "per-micro-batch update: set flow_update: micro_batch")
    if (metric in TOKEN_METRICS) != (entropy_quantile is not None):
        raise ConfigError(f"FlowReward.entropy_quantile is the quantile of the token_entropy metrics: set both or "
                          f"neither (rejection_metric {metric!r}, entropy_quantile {entropy_quantile!r})")
    if flow_update == "micro_batch" and update_every_step:
        raise ConfigError("FlowReward.update_every_step is the buffer's cadence; flow_update: micro_batch updates "
                          "on every step already: set update_every_step false")
    if flow_warmup_steps > 0 and not online_update:
        raise ConfigError("FlowReward.flow_warmup_steps trains the flow with the policy frozen: it needs "
                          "online_update true")
