"""LoRA adapters through peft."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from peft import LoraConfig, get_peft_model
from transformers import PreTrainedModel


@dataclass
class LoraSettings:
    """LoRA on the attention and MLP projections (peft); ``alpha`` scales the update by alpha/r."""

    r: int = 16
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


# Saved in the hyper-parameters of every LoRA run's checkpoint, which Lightning and flowkit load with weights_only.
torch.serialization.add_safe_globals([LoraSettings])


def apply_lora(model: PreTrainedModel, settings: LoraSettings):
    """Wrap ``model`` in a peft ``PeftModel``; only the adapters are trainable."""
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)
