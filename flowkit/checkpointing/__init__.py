"""Fault tolerance, one concern per module.

* :mod:`~flowkit.checkpointing.atomic_files`: :class:`AtomicCheckpointIO`, atomic checkpoint files;
* :mod:`~flowkit.checkpointing.rng_state`: RNG states in checkpoints;
* :mod:`~flowkit.checkpointing.preemption`: a checkpoint on SIGTERM;
* :mod:`~flowkit.checkpointing.resume`: what a fit resumes;
* :mod:`~flowkit.checkpointing.run_lock`: one run at a time in a run directory;
* :mod:`~flowkit.checkpointing.safe_loading`: tensors-only ``torch.load``;
* :mod:`~flowkit.checkpointing.artifacts`: output directories replaced whole.

:func:`fault_tolerance_defaults` is what the ``flowkit`` CLI adds to every Trainer. ``AtomicCheckpointIO`` is also
imported here, as ``flowkit.checkpointing.AtomicCheckpointIO`` is the ``trainer.plugins`` class path the README
documents.
"""

from __future__ import annotations

from typing import Any

from flowkit.checkpointing.atomic_files import AtomicCheckpointIO
from flowkit.checkpointing.preemption import PreemptionCheckpoint
from flowkit.checkpointing.resume import ResumeInPlace
from flowkit.checkpointing.rng_state import RNGStateCheckpoint


def fault_tolerance_defaults() -> dict[str, Any]:
    """Trainer defaults the ``flowkit`` CLI sets: atomic checkpoint files, RNG states, SIGTERM checkpoint."""
    # The plugin as a class_path (unlike the callbacks it is a parser default, and lands in config.yaml).
    plugin = {"class_path": f"{AtomicCheckpointIO.__module__}.{AtomicCheckpointIO.__qualname__}"}
    return {"plugins": [plugin], "callbacks": [RNGStateCheckpoint(), PreemptionCheckpoint(), ResumeInPlace()]}
