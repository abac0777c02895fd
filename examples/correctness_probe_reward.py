"""A worked example of a dense reward model: a linear probe on the policy's latents, learned online.

Each response token t gets r_t = beta · (σ(w·h_t + b) − ½), where h_t is the policy's hidden state at the middle
layer and the probe (w, b) is trained online, on every step's rollouts, to predict from a rollout's mean latent
whether its answer is correct. It uses every part of the reward-model contract (:mod:`flowkit.rewards.base`: a
:class:`~flowkit.rewards.TokenRewardModel` whose ``begin_step`` returns a step scorer with ``score``, ``end_step``
and ``metrics``) and is small enough to read in one go; CI trains it for two RL steps (tests/test_examples.py).
Run it from the repository root
(the working directory is on ``sys.path``, so ``examples.`` imports)::

    flowkit fit --config configs/grpo_tiny.yaml --trainer.default_root_dir runs/probe \\
        --model.init_args.reward_model examples.correctness_probe_reward.CorrectnessProbe \\
        --model.init_args.reward_model.init_args.scoring.beta 0.05

Its step scorer's ``metrics`` (``probe_loss``, ``probe_accuracy``) are logged as ``reward_model/probe_loss`` and
``reward_model/probe_accuracy`` and drawn by ``flowkit plot`` in the "reward model" panel, next to the token-reward
statistics every reward model gets (``train/token_reward/*``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from flowkit.batch import RolloutBatch
from flowkit.rewards import TokenRewardModel


class CorrectnessProbe(TokenRewardModel):
    """Token rewards from a probe of correctness on the latents at layer ``percentile`` · L.

    Args:
        beta: scale of the token rewards (each in [−beta/2, beta/2]).
        percentile: the layer whose latents the probe reads, as a fraction of the depth.
    """

    def __init__(self, beta: float = 0.05, percentile: float = 0.5):
        super().__init__()
        self.beta = beta
        self.percentiles = [percentile]  # the step taps this layer and hands its latents to score()
        self.probe: nn.Linear | None = None

    def bind(self, backbone: nn.Module, layer_positions: Sequence[float], tokenizer=None) -> None:
        # The probe's width is the backbone's; its parameters join the optimizer as the "reward" group (flow_lr).
        self.probe = nn.Linear(backbone.config.hidden_size, 1)

    def begin_step(self, step: int, batch: RolloutBatch) -> ProbeStep:
        return ProbeStep(self.probe, self.beta)  # a fresh scorer: nothing of an earlier (perhaps skipped) step survives


class ProbeStep:
    """One RL step of the probe: scores each micro-batch, keeps its mean latents and labels, and learns from them."""

    def __init__(self, probe: nn.Linear, beta: float):
        self.probe, self.beta = probe, beta
        self.features: list[Tensor] = []
        self.labels: list[Tensor] = []
        self.logged: dict[str, float] = {}

    def score(self, micro: RolloutBatch, rows: Tensor) -> Tensor:
        latents = micro.latents[0].to(self.probe.weight)  # b×S×d: the one tapped layer
        mask = micro.response_mask.to(latents.dtype)
        with torch.no_grad():
            rewards = self.beta * (torch.sigmoid(self.probe(latents).squeeze(-1)) - 0.5) * mask
        # Keep what the online update needs; the step frees the micro-batch's latents after this call.
        self.features.append((latents * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1))
        self.labels.append(micro.correct.to(latents.dtype))
        return rewards  # b×S, like micro.response_mask: check_token_rewards refuses anything else

    def end_step(self, batch: RolloutBatch) -> list[Callable[[], Tensor]]:
        features, labels = torch.cat(self.features), torch.cat(self.labels)

        def loss() -> Tensor:  # one piece; a large buffer would be split into several
            logits = self.probe(features).squeeze(-1)
            value = nn.functional.binary_cross_entropy_with_logits(logits, labels)
            self.logged = {"probe_loss": float(value.detach()),
                           "probe_accuracy": float(((logits > 0) == labels.bool()).float().mean())}
            return value

        return [loss]

    def metrics(self) -> dict[str, float]:
        return self.logged
