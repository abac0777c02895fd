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

import os
from pathlib import Path

from flowkit.checkpointing.artifacts import check_output_directory, replaced_directory
from flowkit.checkpointing.safe_loading import load_trained_weights
from flowkit.errors import ConfigError
from flowkit.registry import subcommand


@subcommand("export")
def export(trainer, model, datamodule, checkpoint: str, out: str = "export", overwrite: bool = False):
    """Write the trained policy (HF ``save_pretrained`` format) and flow (safetensors) from a checkpoint.

    Args:
        checkpoint: a Lightning checkpoint: ``.ckpt`` file, or DeepSpeed (ZeRO-2/3, sharded) directory.
        out: output directory (``hf_policy/`` and ``flow.safetensors``); refused if it holds files, unless
            ``overwrite``.
        overwrite: replace a non-empty ``out`` whole (nothing of its old contents is kept); never a directory
            holding the checkpoint, the run directory or the working directory.
    """
    run_dir = getattr(trainer, "default_root_dir", None)
    sources = {"the checkpoint": checkpoint, "the working directory": os.getcwd(),
               **({"the run directory": run_dir} if run_dir else {})}
    check_keeps_sources(out, sources)
    target = check_output_directory(out, overwrite, "--out")
    load_trained_weights(model, checkpoint)
    with replaced_directory(target) as staging:
        paths = model.export_artifacts(staging)
    for name, path in paths.items():
        print(f"exported {name}: {target / path.relative_to(staging)}")


def check_keeps_sources(out: str, sources: dict[str, str]) -> None:
    """A one-line ConfigError, before anything is touched, when ``--out`` (which ``--overwrite`` replaces whole) is
    one of ``sources`` or a directory above one, or lies inside the checkpoint."""
    target = Path(out).resolve()
    for what, source in sources.items():
        source = Path(source).resolve()
        if target == source or target in source.parents:
            raise ConfigError(f"--out {out!r} holds {what} ({source}), which the export would replace: choose a "
                              f"directory of its own, e.g. --out {Path(out) / 'export'}")
        if what == "the checkpoint" and source in target.parents:
            raise ConfigError(f"--out {out!r} is inside the checkpoint {source}: choose a directory outside it")
