"""Hugging Face backbones: loading, latent taps, rollout generation (plain PyTorch, no Lightning)."""

from flowkit.llm.backbone import BackboneError, load_backbone, resolve_backbone_path
from flowkit.llm.latent_tap import LatentTap, tapped_layer_indices

__all__ = ["BackboneError", "LatentTap", "load_backbone", "resolve_backbone_path", "tapped_layer_indices"]
