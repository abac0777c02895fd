"""Artifacts (an export) replace an output directory whole: checked before any work, swapped in at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from flowkit.errors import ConfigError


def check_output_directory(target: str | Path, overwrite: bool, option: str) -> Path:
    """Refuse, before any work, an output directory that is a file, or that holds files without ``overwrite``.

    Writing new artifacts over old ones would leave a mix (an old full ``model.safetensors`` beside a new
    LoRA adapter loads as neither model); with ``overwrite`` :func:`replaced_directory` replaces it whole.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{option} {str(target)!r} is a file, not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ConfigError(f"{option} {str(target)!r} is not empty: pass --overwrite to replace it, or choose another directory")
    return target


@contextlib.contextmanager
def replaced_directory(target: str | Path) -> Iterator[Path]:
    """Yields an empty staging directory beside ``target``; when the block succeeds it becomes ``target``.

    Whatever ``target`` held before is removed whole, so the result never mixes old and new files; when the
    block fails, ``target`` is left as it was and the staging directory is removed.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".staging", dir=target.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    previous = None
    if target.exists():
        previous = target.with_name(f"{staging.name}.previous")
        os.replace(target, previous)
    os.replace(staging, target)
    if previous is not None:
        shutil.rmtree(previous)
