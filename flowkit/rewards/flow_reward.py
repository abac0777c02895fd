"""RLFR's flow reward: velocity deviation of the policy's latents under a reference flow (§3.3, Alg. 1)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.distributed import ReduceOp

from flowkit.batch import RolloutBatch
from flowkit.distributed import all_reduce_int
from flowkit.flow import VelocityField, flow_matching_loss, sample_logit_normal, velocity_deviation_scores
from flowkit.flow.matching import DEFAULT_MAX_ROWS, Condition, scored_token_mask
from flowkit.rewards.base import TokenRewardModel
from flowkit.rl.rejection import Metric, RolloutLatentBuffer, accept_rollouts
from flowkit.rl.rewards import flow_token_rewards


class FlowReward(TokenRewardModel):
    """Dense reward r_k = −β·𝕀[r̂_k > η]·r̂_k from the debiased deviation R_CFM (eq. 7, 10).

    Args:
        percentiles: layer percentiles P whose latents are scored (last layer excluded).
        depth, width: velocity-field size (width defaults to the backbone's hidden size).
        timesteps: rewarding timesteps T (weights t/(1−t)); also the online update's timesteps.
        eta, beta, top_k: threshold η, scale β and optional top-k of eq. 10.
        condition: which latent conditions the field: the next token's (§3.3), the previous, or none.
        noise_draws: noise draws averaged per reward (variance reduction; the official code uses 1).
        max_rows_per_call: velocity-field rows (token × percentile × timestep) per call when scoring; bounds the
            scoring memory for long rollouts without changing any score. None scores everything in one call.
        seed: base seed of the reward noise; step s uses ``seed + 1000·s`` so rewards are reproducible.
        rejection_metric: which rollouts train the flow online (correct | entropy | both).
        kappa: a flow update happens once at least κ accepted rollouts are buffered; it uses all of them.
        online_update: set False to freeze the flow during RL (ablation).
        pretrain_timesteps: logit-normal timesteps drawn per offline-pretraining batch.
        weights: optional safetensors file of a pretrained velocity field to start from.
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
        condition: Condition = "next",
        noise_draws: int = 1,
        max_rows_per_call: int | None = DEFAULT_MAX_ROWS,
        seed: int = 0,
        rejection_metric: Metric = "correct",
        kappa: int = 32,
        online_update: bool = True,
        pretrain_timesteps: int = 4,
        weights: str | None = None,
    ):
        super().__init__()
        if any(not 0.0 < t < 1.0 for t in timesteps):
            raise ValueError(f"rewarding timesteps must lie in (0, 1) (t/(1−t) weights), got {list(timesteps)}")
        self.percentiles = tuple(percentiles)
        self.depth, self.width = depth, width
        self.timesteps = tuple(timesteps)
        self.eta, self.beta, self.top_k = eta, beta, top_k
        self.condition: Condition = condition
        self.noise_draws, self.seed = noise_draws, seed
        self.max_rows_per_call = max_rows_per_call
        self.rejection_metric: Metric = rejection_metric
        self.kappa, self.online_update = kappa, online_update
        self.pretrain_timesteps = pretrain_timesteps
        self.weights = weights
        self.field: VelocityField | None = None
        self.layer_positions: tuple[float, ...] = ()
        self.buffer = RolloutLatentBuffer()
        self._metrics: dict[str, float] = {}

    def bind(self, hidden_size: int, layer_positions: Sequence[float]) -> None:
        self.layer_positions = tuple(layer_positions)
        self.field = VelocityField(hidden_size, self.width, self.depth, conditioned=self.condition != "none")
        if self.weights:
            self.load_field(self.weights)

    def _require_field(self) -> VelocityField:
        if self.field is None:
            raise RuntimeError("FlowReward.bind(hidden_size, layer_positions) must be called before use")
        return self.field

    def deviation_scores(self, latents: Tensor, response_mask: Tensor, seed: int) -> Tensor:
        """R_CFM per token (B×S, zero where unscored) for latents P×B×S×d."""
        return velocity_deviation_scores(
            self._require_field(), latents, response_mask, self.layer_positions, self.timesteps, seed,
            self.condition, self.noise_draws, self.max_rows_per_call,
        )

    @torch.no_grad()
    def token_rewards(self, batch: RolloutBatch, step: int) -> Tensor:
        scores = self.deviation_scores(batch.latents, batch.response_mask, self.seed + 1000 * step)
        scored = scored_token_mask(batch.response_mask, self.condition)
        rewards = flow_token_rewards(scores, scored, self.eta, self.beta, self.top_k)
        nonzero = (rewards != 0).float().sum() / scored.float().sum().clamp(min=1)
        self._metrics = {"flow/deviation_mean": float(scores[scored].mean()) if scored.any() else 0.0,
                         "flow/reward_mean": float(rewards[scored].mean()) if scored.any() else 0.0,
                         "flow/reward_nonzero_frac": float(nonzero),
                         "flow/loss": float("nan")}  # NaN on steps without a flow update
        return rewards

    def update_loss(self, batch: RolloutBatch, step: int) -> Tensor | None:
        """Alg. 1: buffer the accepted rollouts; once ≥ κ are buffered, the flow loss (eq. 4) on all of them."""
        if not self.online_update:
            return None
        accepted = accept_rollouts(self.rejection_metric, batch.correct, batch.entropy)
        if accepted.any():
            self.buffer.add(batch.latents[:, accepted], batch.response_mask[accepted])
        self._metrics["flow/accepted_frac"] = float(accepted.float().mean())
        # Under DDP / ZeRO the flow step runs collectives and ranks accept different numbers of rollouts (e.g. by
        # correctness): the smallest buffer over all ranks decides, so every rank takes or skips the step together.
        if all_reduce_int(len(self.buffer), ReduceOp.MIN) < self.kappa:
            self._metrics["flow/buffer_size"] = float(len(self.buffer))
            return None
        latents, mask = self.buffer.pop(len(self.buffer))  # one flow step consumes every buffered rollout
        self._metrics["flow/buffer_size"] = float(len(self.buffer))
        device = batch.latents.device
        timesteps = torch.tensor(self.timesteps, device=device)
        loss = flow_matching_loss(self._require_field(), latents.to(device), mask.to(device), self.layer_positions,
                                  timesteps, self.seed + 1000 * step + 1, self.condition)
        self._metrics["flow/loss"] = float(loss.detach())
        return loss

    def pretrain_loss(self, latents: Tensor, response_mask: Tensor, generator: torch.Generator) -> Tensor:
        """Offline flow pretraining (eq. 4): logit-normal timesteps, fresh noise seed from ``generator``."""
        timesteps = sample_logit_normal(self.pretrain_timesteps, generator, latents.device)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        return flow_matching_loss(self._require_field(), latents, response_mask, self.layer_positions, timesteps, seed, self.condition)

    def step_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def save_field(self, path: str | Path) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in self._require_field().state_dict().items()}, str(path))

    def load_field(self, path: str | Path) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"flow weights {str(path)!r} do not exist")
        self._require_field().load_state_dict(load_file(str(path)))

    def get_extra_state(self) -> dict:
        return {"buffer": self.buffer.state_dict()}

    def set_extra_state(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])
