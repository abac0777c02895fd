"""`flowkit export`: a training checkpoint → HF-format policy weights + safetensors flow weights.

Works on both kinds of checkpoint Lightning writes:

* a DeepSpeed checkpoint directory (ZeRO-2 or ZeRO-3, sharded over any number of ranks): the shards are
  consolidated into one fp32 state dict with DeepSpeed's ``zero_to_fp32`` — on CPU, no process group;
* a plain ``.ckpt`` file, loaded with ``weights_only=True``.

Usage (same config as training, so the module is rebuilt with the same shapes)::

    flowkit export --config configs/rlfr_tiny.yaml \\
        --checkpoint runs/rlfr_tiny/version_0/checkpoints/last.ckpt --out export/
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowkit.cli import subcommand


def consolidated_state_dict(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a Lightning checkpoint: a DeepSpeed ZeRO directory or a ``.ckpt`` file."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_dir():
        if not (checkpoint / "latest").is_file():
            raise FileNotFoundError(f"{checkpoint}: a directory but not a DeepSpeed checkpoint (no 'latest' file)")
        from deepspeed.utils.zero_to_fp32 import (
            get_fp32_state_dict_from_zero_checkpoint,
        )

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
        # Checkpoints of Lightning < 2.1 wrapped the module in `_forward_module`.
        return {key.removeprefix("_forward_module."): value for key, value in state.items()}
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint {str(checkpoint)!r} does not exist")
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def load_trained_weights(model: torch.nn.Module, checkpoint: str | Path) -> None:
    """Load ``checkpoint``'s weights into ``model``; every trainable parameter must be in the checkpoint."""
    state = consolidated_state_dict(checkpoint)
    missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in state]
    if missing:
        raise KeyError(f"{checkpoint}: no weights for {len(missing)} trainable parameter(s), e.g. {missing[:3]}")
    # Non-parameter entries (e.g. the flow's rollout buffer in `_extra_state`) are training state, not weights.
    unexpected = model.load_state_dict(state, strict=False).unexpected_keys
    if unexpected:
        raise KeyError(f"{checkpoint}: weights the model does not have, e.g. {unexpected[:3]}")


@subcommand("export")
def export(trainer, model, datamodule, checkpoint: str, out: str = "export"):
    """Write the trained policy (HF ``save_pretrained`` format) and flow (safetensors) from a checkpoint.

    Args:
        checkpoint: a Lightning checkpoint: ``.ckpt`` file, or DeepSpeed (ZeRO-2/3, sharded) directory.
        out: output directory (``hf_policy/`` and ``flow.safetensors``).
    """
    load_trained_weights(model, checkpoint)
    for name, path in model.export_artifacts(out).items():
        print(f"exported {name}: {path}")
