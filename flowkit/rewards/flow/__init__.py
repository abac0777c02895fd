"""Flow matching on hidden states: the velocity field and the path / loss / deviation math (RLFR §3)."""

from flowkit.rewards.flow.matching import (
    flow_matching_loss_pieces,
    padding_velocity,
    pretraining_loss_pieces,
    sample_logit_normal,
    scored_token_mask,
    velocity_deviation_scores,
)
from flowkit.rewards.flow.field import VelocityField

__all__ = [
    "VelocityField",
    "flow_matching_loss_pieces",
    "padding_velocity",
    "pretraining_loss_pieces",
    "sample_logit_normal",
    "scored_token_mask",
    "velocity_deviation_scores",
]
