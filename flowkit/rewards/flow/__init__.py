"""RLFR's flow reward, one concept per file, the layers of the method from the bottom up:

- :mod:`~flowkit.rewards.flow.field`: the velocity field v_φ (an AdaLN MLP conditioned on t, the layer and a token).
- :mod:`~flowkit.rewards.flow.matching`: flow matching on tapped latents — the loss (eq. 4) and the debiased velocity
  deviation (eq. 5–7), on the fused kernels of :mod:`flowkit.kernels`.
- :mod:`~flowkit.rewards.flow.scoring`: token rewards from the deviation (eq. 10) and the official code's variants.
- :mod:`~flowkit.rewards.flow.rejection`: which rollouts (and tokens) train the flow online (Alg. 1).
- :mod:`~flowkit.rewards.flow.options`: the option groups and the paper / official protocol presets.
- :mod:`~flowkit.rewards.flow.online`: one RL step's scoring and online loss (:class:`FlowStep`).
- :mod:`~flowkit.rewards.flow.reward`: :class:`FlowReward`, the reward model that composes them.
- :mod:`~flowkit.rewards.flow.expert_latents`: the policy's latents of expert solutions, the offline pretraining's
  data (the Lightning loop that runs it is :mod:`flowkit.modules.pretraining`).

The method with the paper's equations, and where the paper and the official code differ: docs/methods/rlfr.md.
"""

from flowkit.rewards.flow.field import VelocityField
from flowkit.rewards.flow.matching import (
    flow_matching_loss_pieces,
    padding_velocity,
    pretraining_loss_pieces,
    sample_logit_normal,
    scored_token_mask,
    velocity_deviation_scores,
)
from flowkit.rewards.flow.online import FlowStep
from flowkit.rewards.flow.options import (
    LatentOptions, NetworkOptions, OnlineOptions, PretrainingOptions, ScoringOptions,
)
from flowkit.rewards.flow.reward import FlowReward

__all__ = [
    "FlowReward",
    "FlowStep",
    "LatentOptions",
    "NetworkOptions",
    "OnlineOptions",
    "PretrainingOptions",
    "ScoringOptions",
    "VelocityField",
    "flow_matching_loss_pieces",
    "padding_velocity",
    "pretraining_loss_pieces",
    "sample_logit_normal",
    "scored_token_mask",
    "velocity_deviation_scores",
]
