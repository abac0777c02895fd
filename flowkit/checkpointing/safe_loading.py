"""Safe loading: every ``torch.load`` — DeepSpeed's too — loads tensors and plain data only; the trained weights of a
checkpoint (a file or a DeepSpeed ZeRO directory) are read through it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from flowkit.checkpointing.atomic_files import previous_checkpoint_path, unreadable_checkpoint
from flowkit.errors import ConfigError, RunError


class UnsafeCheckpointError(ConfigError):
    """A checkpoint holds pickled objects other than tensors, plain data and DeepSpeed's bookkeeping types."""


# The non-tensor objects DeepSpeed writes into its own checkpoint files (``*_optim_states.pt``; found by loading
# CPU ZeRO-2/3 checkpoints), and the LoRA settings a module's hyper-parameters may hold. Unpickling one of them
# calls that class with plain values from the file, which runs none of the file's code.
_CHECKPOINT_TYPES = (
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("flowkit.llm.lora", "LoraSettings"),
)

_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


@contextlib.contextmanager
def tensors_only_loading(checkpoint: str | Path) -> Iterator[None]:
    """Every ``torch.load`` in the block loads tensors and plain data only (plus :data:`_CHECKPOINT_TYPES`).

    Also DeepSpeed's loaders (``zero_to_fp32``, the engine's ``load_checkpoint``), which ask for
    ``weights_only=False``: torch honours ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` over the argument. A file holding
    any other object raises :class:`UnsafeCheckpointError` naming it, before that object is built.
    """
    allowed = [getattr(importlib.import_module(module), name) for module, name in _CHECKPOINT_TYPES
               if importlib.util.find_spec(module.split(".")[0]) is not None]
    previous = os.environ.get(_FORCE_WEIGHTS_ONLY)
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(allowed):
            yield
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        if found is None:  # not a refused object (e.g. a truncated file): the original error says more
            raise
        raise UnsafeCheckpointError(f"refusing to load checkpoint {str(checkpoint)!r}: it holds a pickled "
                                    f"{found.group(1)}; flowkit loads only tensors, plain data and DeepSpeed's "
                                    "own checkpoint types") from None
    finally:
        if previous is None:
            os.environ.pop(_FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[_FORCE_WEIGHTS_ONLY] = previous


def consolidated_state_dict(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a Lightning checkpoint: a DeepSpeed ZeRO directory or a ``.ckpt`` file.

    Loads tensors and plain data only (:func:`tensors_only_loading`), also from DeepSpeed's files.
    """
    checkpoint = Path(checkpoint)
    if checkpoint.is_dir():
        if not (checkpoint / "latest").is_file():
            raise FileNotFoundError(f"{checkpoint}: a directory but not a DeepSpeed checkpoint (no 'latest' file)")
        from deepspeed.utils.zero_to_fp32 import (
            get_fp32_state_dict_from_zero_checkpoint,
        )

        with tensors_only_loading(checkpoint):
            state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
        # Checkpoints of Lightning < 2.1 wrapped the module in `_forward_module`.
        return {key.removeprefix("_forward_module."): value for key, value in state.items()}
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint {str(checkpoint)!r} does not exist")
    with tensors_only_loading(checkpoint):
        try:
            loaded = torch.load(checkpoint, map_location="cpu", weights_only=True)
            if isinstance(loaded, dict) and "state_dict" in loaded:
                return loaded["state_dict"]
            what = ("the state of an offline flow pretraining; its flow reaches export/ once the RL run that "
                    "continues it saves a checkpoint" if isinstance(loaded, dict) and "steps_done" in loaded
                    else "no model weights")
            raise ConfigError(f"checkpoint {str(checkpoint)!r} is no Lightning training checkpoint ({what}); "
                              "pass the run's checkpoints/last.ckpt")
        except Exception as err:
            problem = unreadable_checkpoint(err)
            if problem is None:
                raise
        previous = previous_checkpoint_path(checkpoint)
        kept = f"; the one before it is {previous}" if previous.is_file() else ""
        raise RunError(f"checkpoint {str(checkpoint)!r} cannot be read: {problem}{kept}")


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
