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

from flowkit.checkpointing.artifacts import check_output_directory, replaced_directory
from flowkit.checkpointing.safe_loading import load_trained_weights
from flowkit.registry import subcommand


@subcommand("export")
def export(trainer, model, datamodule, checkpoint: str, out: str = "export", overwrite: bool = False):
    """Write the trained policy (HF ``save_pretrained`` format) and flow (safetensors) from a checkpoint.

    Args:
        checkpoint: a Lightning checkpoint: ``.ckpt`` file, or DeepSpeed (ZeRO-2/3, sharded) directory.
        out: output directory (``hf_policy/`` and ``flow.safetensors``); refused if it holds files, unless
            ``overwrite``.
        overwrite: replace a non-empty ``out`` whole (nothing of its old contents is kept).
    """
    target = check_output_directory(out, overwrite, "--out")
    load_trained_weights(model, checkpoint)
    with replaced_directory(target) as staging:
        paths = model.export_artifacts(staging)
    for name, path in paths.items():
        print(f"exported {name}: {target / path.relative_to(staging)}")
