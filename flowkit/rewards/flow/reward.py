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
from flowkit.rewards.flow import VelocityField, padding_velocity, pretraining_loss_pieces, velocity_deviation_scores
from flowkit.rewards.flow.matching import DEFAULT_MAX_ROWS, Condition, LossPiece, scored_token_mask
from flowkit.rewards.base import TokenRewardModel
from flowkit.rewards.flow.online import FlowStep
from flowkit.rewards.flow.rejection import METRICS, TOKEN_METRICS, Metric, RolloutLatentBuffer
from flowkit.rewards.flow.scoring import NORMALIZATIONS, Normalization, flow_token_rewards
from flowkit.seeding import flow_noise_seed, run_seed

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
            ``mean``: min-max minus the row mean, |r̂| > η); see :mod:`flowkit.rewards.flow.scoring`.
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
        seed: base seed of the reward noise (step s draws from :func:`~flowkit.seeding.flow_noise_seed`, so rewards
            are reproducible) and of the field's initialisation, which runs on its own RNG so it never shifts the
            policy's sampling.
            ``None`` (default): the run's global seed (``seed_everything``); an int pins it.
        rejection_metric: which rollouts train the flow online (:mod:`flowkit.rewards.flow.rejection`): ``correct``
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
            gradient accumulation). flowkit takes one flow step per RL step, on all of the step's micro-batches; the
            official steps the flow once per policy minibatch, on that minibatch's micro-batches (the same with
            ``update.num_minibatches`` 1; ``num_minibatches`` N: N flow steps per RL step there, 1 here). flowkit
            skips the flow step when no rank has a weighted row, where the official steps its optimizer on a zero
            gradient (Adam's momentum alone moves it), and scores a row whose token weights are all 0 as 0 where the
            official divides by 0.
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
            ``--freezing_actor_steps_for_flow N``: its steps 1…N). ``trainer.max_steps`` counts optimizer steps: a
            warm-up RL step is one (the flow's), a later one ``ppo_epochs × num_minibatches``; so N warm-up steps
            take N of ``max_steps``, not N × num_minibatches.
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
        self.buffer = RolloutLatentBuffer()  # accepted rollouts until the online update takes them (Alg. 1)

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

    def begin_step(self, step: int, batch: RolloutBatch) -> FlowStep:
        """Step ``step``'s scorer (:class:`~flowkit.rewards.flow.online.FlowStep`): its token rewards and online loss."""
        return FlowStep(self, step, batch)

    def freezes_policy(self, step: int) -> bool:
        """``flow_warmup_steps``: the first N RL steps train the flow only."""
        return step < self.flow_warmup_steps

    @torch.no_grad()
    def token_rewards(self, batch: RolloutBatch, step: int, token_offset: int = 0,
                      sums: dict[str, Tensor] | None = None) -> Tensor:
        """Eq. 10 rewards of ``batch``'s rows at step ``step``, whose first scored token is noise slot
        ``token_offset``. With ``sums``, the logged sums of deviations, rewards, nonzero and scored tokens are added
        to it, on the device (float64, as Python floats add): no host sync per micro-batch."""
        scores = self.deviation_scores(batch.latents, batch.response_mask, flow_noise_seed(self.seed, step),
                                       token_offset)
        scored = scored_token_mask(batch.response_mask, self.condition)
        rewards = flow_token_rewards(scores, scored, self.eta, self.beta, self.top_k, self.normalization,
                                     self.score_power)
        if sums is not None:
            for key, value in {"deviation": scores[scored].sum(), "reward": rewards[scored].sum(),
                               "nonzero": (rewards[scored] != 0).sum(), "scored": scored.sum()}.items():
                value = value.double()
                sums[key] = sums[key] + value if key in sums else value
        return rewards

    def pretrain_losses(self, latents: Tensor, response_mask: Tensor, generator: torch.Generator) -> list[LossPiece]:
        """Offline flow pretraining (eq. 4) as the official: ``pretrain_timesteps`` copies of every token, one
        logit-normal t (location ``pretrain_logit_mean``) and one noise draw per copy, all from ``generator``; in
        pieces of at most ``max_rows_per_piece`` field rows that sum to the loss, to backpropagate one at a time."""
        pieces = pretraining_loss_pieces(self._require_field(), latents, response_mask, self.layer_positions,
                                         self.pretrain_timesteps, generator, self.condition, self.pretrain_logit_mean,
                                         self.max_rows_per_piece)
        return self.agreed_over_ranks(pieces)

    def agreed_over_ranks(self, pieces: list[LossPiece]) -> list[LossPiece]:
        """Every rank backpropagates as many pieces as the rank with the most (each backward reduces gradients, and
        under ZeRO-3 each field call gathers weights); the extra pieces run the field on a dummy row, × 0."""
        field = self._require_field()
        padding = all_reduce_int(len(pieces), ReduceOp.MAX) - len(pieces)
        return pieces + [lambda: padding_velocity(field).sum() * 0.0] * padding

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
