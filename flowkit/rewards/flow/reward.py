"""RLFR's flow reward: velocity deviation of the policy's latents under a reference flow (§3.3, Alg. 1)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.distributed import ReduceOp

from flowkit.batch import RolloutBatch
from flowkit.distributed import all_reduce_int
from flowkit.errors import ConfigError, check_range
from flowkit.options import moved_options
from flowkit.rewards.base import TokenRewardModel
from flowkit.rewards.flow.field import VelocityField
from flowkit.rewards.flow.matching import (
    LossPiece, flow_matching_loss_pieces, padding_velocity, pretraining_loss_pieces, scored_token_mask,
    velocity_deviation_scores,
)
from flowkit.rewards.flow.online import FlowStep
from flowkit.rewards.flow.options import (
    GROUPS, FlowProtocol, LatentOptions, NetworkOptions, OnlineOptions, PretrainingOptions, ScoringOptions, resolve,
)
from flowkit.rewards.flow.rejection import RolloutLatentBuffer
from flowkit.rewards.flow.scoring import flow_token_rewards
from flowkit.seeding import flow_noise_seed, run_seed

MOVED_OPTIONS: dict[str, str] = moved_options(GROUPS)


class FlowReward(TokenRewardModel):
    """Dense reward r_k = −β·𝕀[r̂_k > η]·r̂_k from the debiased deviation R_CFM (eq. 7, 10) of the policy's latents
    under a reference flow, trained offline on expert latents and online on the policy's accepted rollouts (Alg. 1).

    Args:
        protocol: fills every option left null where the paper and the official code differ
            (:data:`~flowkit.rewards.flow.options.PRESETS`): ``flowkit`` (the default: the official scoring with the
            paper's online Alg. 1), ``paper`` (the RLFR paper's text) or ``official`` (what the official RL scripts
            run, the online flow frozen: docs/methods/rlfr.md).
        latents, network, scoring, online, pretraining: the option groups (:mod:`flowkit.rewards.flow.options`).
        seed: base seed of the reward noise (step s draws from :func:`~flowkit.seeding.flow_noise_seed`, so rewards
            are reproducible) and of the field's initialisation, which runs on its own RNG so it never shifts the
            policy's sampling; null: the run's global seed (``seed_everything``).
        weights: optional safetensors file of a pretrained velocity field to start from; a missing file, an unreadable
            one, or one of another depth / width / hidden size is a :class:`~flowkit.errors.ConfigError`.
    """

    MOVED_OPTIONS = MOVED_OPTIONS  # the CLI names the new key of an option of the old flat form

    def __init__(
        self,
        protocol: FlowProtocol = "flowkit",
        latents: LatentOptions = LatentOptions(),
        network: NetworkOptions = NetworkOptions(),
        scoring: ScoringOptions = ScoringOptions(),
        online: OnlineOptions = OnlineOptions(),
        pretraining: PretrainingOptions = PretrainingOptions(),
        seed: int | None = None,
        weights: str | None = None,
    ):
        super().__init__()
        groups = {key: resolve(protocol, key, group) for key, group in
                  {"latents": latents, "network": network, "scoring": scoring, "online": online,
                   "pretraining": pretraining}.items()}
        for key, group in groups.items():
            group.check(f"FlowReward.{key}")
        check_range("FlowReward", "seed", seed, 0)
        if weights is not None and not Path(weights).is_file():
            raise ConfigError(f"FlowReward.weights {weights!r} is not a file")
        self.protocol = protocol
        self.latents: LatentOptions = groups["latents"]
        self.network: NetworkOptions = groups["network"]
        self.scoring: ScoringOptions = groups["scoring"]
        self.online: OnlineOptions = groups["online"]
        self.pretraining: PretrainingOptions = groups["pretraining"]
        self.percentiles = tuple(self.latents.percentiles)
        self.seed, self.weights = run_seed(seed), weights
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
            self.field = VelocityField(config.hidden_size, self.network.width, self.network.depth,
                                       conditioned=self.latents.condition != "none", norm_eps=eps)
        if self.weights:
            self.load_field(self.weights)

    def _require_field(self) -> VelocityField:
        if self.field is None:
            raise RuntimeError("FlowReward.bind(backbone, layer_positions) must be called before use")
        return self.field

    def deviation_scores(self, latents: Tensor, response_mask: Tensor, seed: int, token_offset: int = 0) -> Tensor:
        """R_CFM per token (B×S, zero where unscored) for latents P×B×S×d; ``token_offset`` keys the noise of
        a micro-batch by its global scored-token index (see :meth:`scored_token_counts`)."""
        scoring = self.scoring
        return velocity_deviation_scores(
            self._require_field(), latents, response_mask, self.layer_positions, scoring.timesteps, seed,
            self.latents.condition, scoring.noise_draws, self.network.max_rows_per_call, token_offset, scoring.debias,
        )

    def scored_token_counts(self, response_mask: Tensor) -> Tensor:
        """B: how many tokens of each row are scored (each a noise slot)."""
        return scored_token_mask(response_mask, self.latents.condition).sum(-1)

    def begin_step(self, step: int, batch: RolloutBatch) -> FlowStep:
        """Step ``step``'s scorer (:class:`~flowkit.rewards.flow.online.FlowStep`): its token rewards and online
        loss."""
        return FlowStep(self, step, batch)

    def freezes_policy(self, step: int) -> bool:
        """``online.flow_warmup_steps``: the first N RL steps train the flow only."""
        return step < self.online.flow_warmup_steps

    @torch.no_grad()
    def token_rewards(self, batch: RolloutBatch, step: int, token_offset: int = 0,
                      sums: dict[str, Tensor] | None = None) -> Tensor:
        """Eq. 10 rewards of ``batch``'s rows at step ``step`` on the tokens the policy sampled (``loss_mask``: an
        agent episode's environment tokens condition the latents and are never scored), whose first scored token is
        noise slot
        ``token_offset``. With ``sums``, the logged sums of deviations, rewards, nonzero and scored tokens are added
        to it, on the device (float64, as Python floats add): no host sync per micro-batch."""
        scores = self.deviation_scores(batch.latents, batch.loss_mask, flow_noise_seed(self.seed, step),
                                       token_offset)
        scored = scored_token_mask(batch.loss_mask, self.latents.condition)
        scoring = self.scoring
        rewards = flow_token_rewards(scores, scored, scoring.eta, scoring.beta, scoring.top_k, scoring.normalization,
                                     scoring.score_power)
        if sums is not None:
            for key, value in {"deviation": scores[scored].sum(), "reward": rewards[scored].sum(),
                               "nonzero": (rewards[scored] != 0).sum(), "scored": scored.sum()}.items():
                value = value.double()
                sums[key] = sums[key] + value if key in sums else value
        return rewards

    def online_losses(self, latents: Tensor, mask: Tensor, step: int,
                      token_weights: Tensor | None = None) -> list[LossPiece]:
        """The online update's eq. 4 on ``latents`` P×B×S×d at the rewarding timesteps, with step ``step``'s noise,
        in pieces of at most ``network.max_rows_per_piece`` field rows that sum to it (unpadded: see
        :meth:`agreed_over_ranks`)."""
        return flow_matching_loss_pieces(
            self._require_field(), latents, mask, self.layer_positions, torch.tensor(self.scoring.timesteps),
            flow_noise_seed(self.seed, step, online_loss=True), self.latents.condition,
            self.network.max_rows_per_piece, token_weights=token_weights)

    def pretrain_losses(self, latents: Tensor, response_mask: Tensor, generator: torch.Generator) -> list[LossPiece]:
        """Offline flow pretraining (eq. 4) as the official: ``pretrain_timesteps`` copies of every token, one
        logit-normal t (location ``pretrain_logit_mean``) and one noise draw per copy, all from ``generator``, on the
        pretraining's condition; in pieces of at most ``network.max_rows_per_piece`` field rows that sum to the loss,
        to backpropagate one at a time."""
        options = self.pretraining
        pieces = pretraining_loss_pieces(self._require_field(), latents, response_mask, self.layer_positions,
                                         options.pretrain_timesteps, generator,
                                         options.pretrain_condition or self.latents.condition,
                                         options.pretrain_logit_mean, self.network.max_rows_per_piece)
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
            raise ConfigError(f"flow weights {str(path)!r} do not fit this FlowReward (depth {self.network.depth}, "
                              f"width {field.width}, hidden size {field.hidden_size}): {len(missing)} missing, "
                              f"{len(unexpected)} unexpected, {len(resized)} differently shaped tensors (first: {first!r})")
        field.load_state_dict(state)

    def get_extra_state(self) -> dict:
        return {"buffer": self.buffer.state_dict()}

    def set_extra_state(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])

