"""Fault tolerance: atomic checkpoint files, RNG state in checkpoints, a checkpoint on SIGTERM.

* :class:`AtomicCheckpointIO` writes a checkpoint to a temporary file in the target's own directory,
  fsyncs it and ``os.replace``-s it over the target: a kill at any moment leaves either the old or the
  new checkpoint, never a truncated one. (Lightning's default writes through an fsspec transaction whose
  temporary file lives in the system temp dir; when that is another filesystem the final move is a
  copy, which a kill can interrupt.) It keeps the checkpoint a save replaces as ``<name>.previous`` and
  resumes from that one when the checkpoint itself cannot be read; a failed write (a full disk) is one line.
* :func:`lock_run_directory`: one run at a time in a run directory.
* :class:`RNGStateCheckpoint` stores the torch (CPU and CUDA), numpy and Python RNG states and restores
  them right before the first training batch after a resume — not at load time, because building the
  dataloader iterator draws from the torch RNG in between.
* :class:`PreemptionCheckpoint` builds on Lightning's SIGTERM handling: Lightning notes the signal, lets
  the running batch finish and stops with ``SIGTERMException`` (a ``SystemExit``); this callback writes
  ``last.ckpt`` (where ``--ckpt_path last`` finds it) before the process exits with status 0. Work that runs
  before training (offline flow pretraining) handles SIGTERM itself with :func:`sigterm_stops`.
* :func:`tensors_only_loading` makes every ``torch.load`` — DeepSpeed's too — load tensors and plain data only;
  :func:`consolidated_state_dict` and the DeepSpeed strategies load checkpoints through it.
* :func:`check_output_directory` and :func:`replaced_directory`: artifacts replace an output directory whole.

:func:`fault_tolerance_defaults` is what the ``flowkit`` CLI adds to every Trainer.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import importlib.util
import logging
import os
import pickle
import random
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from flowkit.distributed import all_reduce_int
from flowkit.errors import ConfigError, RunError

log = logging.getLogger(__name__)

RNG_KEY = "rng_states"
VALIDATION_INTERRUPTED_KEY = "validation_interrupted"  # in PreemptionCheckpoint's state
PRETRAINING_STATE_NAME = "flow_pretrain.ckpt"  # no "last" in it: `--ckpt_path last` must not pick it
PREVIOUS_SUFFIX = ".previous"  # no ".ckpt" at the end: `--ckpt_path last` must not pick it either


def previous_checkpoint_path(path: str | Path) -> Path:
    """Where :class:`AtomicCheckpointIO` keeps the checkpoint that a save over ``path`` replaced."""
    path = Path(path)
    return path.with_name(path.name + PREVIOUS_SUFFIX)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to ``.<name>.<host>.<pid>.tmp`` beside the target, fsync, then ``os.replace`` onto it.

    The temporary name is the writer's own (host and process id), so processes saving into one directory
    never write into each other's file, and a reader of the target only ever sees a whole checkpoint. The
    temporary files that killed writers of the same target on this host left behind are removed. A write that
    fails (a full disk) raises :class:`~flowkit.errors.RunError` naming the file; the target stays as it was.

    With ``keep_previous`` (default) the whole checkpoint a save replaces stays as ``<name>.previous`` (a hard link,
    so nothing is copied; the disk holds two checkpoints of each name), and :meth:`load_checkpoint` resumes from it,
    with a one-line warning, when the checkpoint asked for cannot be read (truncated, empty, damaged after it was
    written). At every moment of a save the target holds a whole checkpoint, so a run always keeps a good one.
    Single-file checkpoints only: DeepSpeed writes its checkpoint directories itself.
    """

    def __init__(self, keep_previous: bool = True):
        super().__init__()
        self.keep_previous = keep_previous

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        temporary = _temporary_path(path)
        previous_staged = _temporary_path(previous_checkpoint_path(path))
        created: list[Path] = []  # only what this save created is removed after it, never a file planted there
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for leftover in (temporary, previous_staged):
                _remove_own_leftover(leftover)
            with open_new_file(temporary) as f:
                created.append(temporary)
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            if self.keep_previous and path.is_file() and not path.is_symlink() and _is_whole(path):
                _link_or_copy(path, previous_staged)
                created.append(previous_staged)
                os.replace(previous_staged, previous_checkpoint_path(path))
            os.replace(temporary, path)  # replaces a link at `path` itself, never the file it points to
            _fsync_directory(path.parent)
        except PlantedFileError:
            raise
        except Exception as err:
            cause = _os_error(err)
            if cause is None:
                raise
            kept = f"{path.name} there is unchanged" if path.exists() else "nothing was saved"
            raise RunError(f"cannot write checkpoint {path}: {cause.strerror or cause}; {kept}") from None
        finally:
            for name in created:
                name.unlink(missing_ok=True)
        _remove_orphaned_temporaries(path)
        _remove_orphaned_temporaries(previous_checkpoint_path(path))

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """The checkpoint at ``path``; if it cannot be read, the previous one kept beside it, with a warning."""
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except FileNotFoundError:
            raise RunError(f"checkpoint {path} does not exist") from None
        except Exception as err:
            problem = unreadable_checkpoint(err)
            if problem is None:
                raise
        previous = previous_checkpoint_path(path)
        if not previous.is_file():
            raise RunError(f"cannot resume from {path}: {problem}, and no previous checkpoint ({previous.name}) is "
                           "kept beside it; pass another --ckpt_path, or start a new run with --trainer.default_root_dir")
        try:
            checkpoint = super().load_checkpoint(previous, map_location=map_location, weights_only=weights_only)
        except Exception as err:
            if unreadable_checkpoint(err) is None:
                raise
            raise RunError(f"cannot resume from {path} ({problem}) nor from {previous} "
                           f"({unreadable_checkpoint(err)})") from None
        log.warning("%s cannot be read (%s): resuming from the checkpoint before it, %s (step %s)", path, problem,
                    previous, checkpoint.get("global_step", "?"))
        return checkpoint

    def remove_checkpoint(self, path: str | Path) -> None:
        super().remove_checkpoint(path)
        previous_checkpoint_path(path).unlink(missing_ok=True)


def _temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def _is_whole(path: Path) -> bool:
    """Does ``path`` end in a complete zip directory, as every ``torch.save`` file does? A truncated or empty one
    does not."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (OSError, zipfile.BadZipFile):
        return False


class PlantedFileError(RunError):
    """A file or link already stands where flowkit creates a run-directory file of its own."""


def open_new_file(path: Path) -> BinaryIO:
    """``path`` created for writing, exclusively and without following links (``O_CREAT | O_EXCL | O_NOFOLLOW``):
    a file or symlink someone planted there is never written through; it is a :class:`PlantedFileError` instead."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        raise _planted(path, "flowkit creates its own new file") from None
    return os.fdopen(fd, "wb")


def _remove_own_leftover(path: Path) -> None:
    """Remove a file at one of this process's temporary names: what a killed writer with this process id left (in a
    container a restarted job often gets the same id). Removing a name never touches the file behind it; a symlink
    there is left for :func:`open_new_file` to refuse."""
    if not path.is_symlink():
        path.unlink(missing_ok=True)


def _planted(path: Path, where: str) -> PlantedFileError:
    kind = "a symlink" if path.is_symlink() else "a file"
    return PlantedFileError(f"refusing to write {path}: {kind} is there, where {where} (planted by someone who can "
                            "write in the run directory?); nothing was written through it: remove it and run again")


def _link_or_copy(source: Path, destination: Path) -> None:
    """A hard link (or, where there are none, a copy) of ``source`` at the new file ``destination``."""
    try:
        os.link(source, destination, follow_symlinks=False)
    except FileExistsError:
        raise _planted(destination, "flowkit creates its own new file") from None
    except OSError:  # a filesystem without hard links
        with source.open("rb") as src, open_new_file(destination) as dst:
            shutil.copyfileobj(src, dst)


def _os_error(err: BaseException) -> OSError | None:
    """The operating system's error behind ``err`` (torch.save reports a failed write as a RuntimeError)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def unreadable_checkpoint(err: BaseException) -> str | None:
    """Why ``torch.load`` could not read a checkpoint file (truncated, empty, not torch's format), in a few words; None
    for any other error, in particular an object refused by :func:`tensors_only_loading`, which must stay an error."""
    if isinstance(err, pickle.UnpicklingError) and "GLOBAL" in str(err):
        return None
    if isinstance(err, EOFError):
        return "the file is empty or ends early"
    if isinstance(err, (RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile)):
        return str(err).split(". ")[0].strip().removesuffix(".") or type(err).__name__
    return None


def _remove_orphaned_temporaries(path: Path) -> None:
    """Delete ``path``'s temporary files whose writer (a process on this host) no longer runs."""
    prefix = f".{path.name}.{socket.gethostname()}."
    for temporary in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = temporary.name[len(prefix):-len(".tmp")]
        if pid.isdigit() and not _process_exists(int(pid)):
            temporary.unlink(missing_ok=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX: a rename is persisted by syncing the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_states() -> dict[str, Any]:
    """All global RNG states: torch CPU, torch CUDA (if initialised), numpy, Python."""
    states = {
        "torch": torch.get_rng_state(),
        "numpy": _numpy_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    numpy = states["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"],
                         numpy["cached_gaussian"]))
    random.setstate(_as_python_state(states["python"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _numpy_state() -> dict[str, Any]:
    # Plain tensors and numbers, so the checkpoint still loads with torch.load(weights_only=True).
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian)}


def _as_python_state(state: Any) -> tuple:
    # A weights_only load turns the (version, tuple, gauss) state into lists; random.setstate wants tuples.
    version, internal, gauss = state
    return version, tuple(internal), gauss


class RNGStateCheckpoint(L.Callback):
    """Saves every rank's RNG states in the checkpoint; restores them before the first resumed batch."""

    def __init__(self):
        self._pending: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        states = [rng_states()]
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            # Rank 0 may be the only writer, so it keeps every rank's states.
            states = [None] * trainer.world_size
            torch.distributed.all_gather_object(states, rng_states())
        checkpoint[RNG_KEY] = states

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get(RNG_KEY)
        if states is None:
            log.warning("checkpoint has no RNG states; the resumed run will not repeat the interrupted one exactly")
            return
        if len(states) != trainer.world_size:
            log.warning("checkpoint holds RNG states of %d ranks, this run has %d; not restoring them",
                        len(states), trainer.world_size)
            return
        self._pending = states[trainer.global_rank]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._pending is not None:
            set_rng_states(self._pending)
            self._pending = None


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, write ``<checkpoint dir>/last.ckpt`` after the running batch; the process then exits 0.

    SIGTERM during a validation stops it after its running batch: the checkpoint then records that the validation
    did not finish, and the resumed fit runs it again, first thing (a run stopped in its final validation would
    otherwise resume with nothing left to train and end without its held-out numbers).
    """

    def __init__(self):
        self._validation_interrupted = False
        self._validation_pending = False
        self._step = 0  # of the checkpoint; the trainer's global_step is restored only later

    def state_dict(self) -> dict[str, Any]:
        return {VALIDATION_INTERRUPTED_KEY: self._validation_interrupted, "step": self._step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._validation_pending = bool(state_dict.get(VALIDATION_INTERRUPTED_KEY, False))
        self._step = int(state_dict.get("step", 0))

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Strategies other than DeepSpeed restored the weights and this state already; a fit whose checkpoint met
        # max_steps skips the training loop, and with it on_train_start.
        self._validate_if_pending(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._validate_if_pending(trainer)  # DeepSpeed restores after on_fit_start

    def _validate_if_pending(self, trainer: L.Trainer) -> None:
        if not self._validation_pending:
            return
        self._validation_pending = False
        log.warning("the checkpoint was saved in a validation that SIGTERM stopped: validating step %d again",
                    self._step)
        trainer.validating = True  # what the training loop does around its own validations
        trainer.fit_loop.epoch_loop.val_loop.run()
        trainer.training = True

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        if isinstance(exception, PretrainingPreempted):
            return  # stopped before training began; the pretraining saved its own state
        self._validation_interrupted, self._step = trainer.validating, trainer.global_step
        path = self.last_checkpoint_path(trainer)
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            # ModelCheckpoint's state inside this checkpoint then names it as the last one: after resuming,
            # ModelCheckpoint overwrites last.ckpt instead of writing last-v1.ckpt next to a stale last.ckpt.
            callback.last_model_path = str(path)
        log.warning("SIGTERM: saving %s at step %d before exiting", path, trainer.global_step)
        trainer.save_checkpoint(path)

    @staticmethod
    def pretraining_state_path(trainer: L.Trainer) -> Path:
        """Where work before training (offline flow pretraining) keeps its resumable state: beside ``last.ckpt``."""
        return PreemptionCheckpoint.last_checkpoint_path(trainer).with_name(PRETRAINING_STATE_NAME)

    @staticmethod
    def last_checkpoint_path(trainer: L.Trainer) -> Path:
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            directory = Path(callback.dirpath)
            name = callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION
        else:
            directory = Path(trainer.default_root_dir) / "checkpoints"
            name = ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION
        return directory / name


class PretrainingPreempted(SIGTERMException):
    """SIGTERM arrived before training began (e.g. in offline flow pretraining), whose state is saved already.

    A ``SystemExit`` like Lightning's own ``SIGTERMException``: the process exits with status 0.
    """


@contextlib.contextmanager
def sigterm_stops() -> Iterator[Callable[[], bool]]:
    """Within the block SIGTERM only raises a flag; yields ``stop()``: has any rank received it?

    For work that runs before Lightning installs its own SIGTERM handling (which happens only when training
    starts): check ``stop()`` once per step, save what resumes the work, and raise :class:`PretrainingPreempted`.
    ``stop()`` is a collective under a process group, so every rank must call it at every step; the ranks
    then stop at the same step even when the signal reached only one of them.
    """
    received = False

    def note(signum, frame) -> None:
        nonlocal received
        received = True
        log.warning("SIGTERM received: stopping after this step")

    def stop() -> bool:
        return bool(all_reduce_int(int(received), torch.distributed.ReduceOp.MAX))

    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield stop
        return
    previous = signal.signal(signal.SIGTERM, note)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------------------ what a fit resumes

EXPORTED_KEY = "exported"  # in a checkpoint: the fit had written its artifacts (flowkit.modules.ExportArtifacts)
HPC_CHECKPOINT_GLOB = "hpc_ckpt_*.ckpt"  # Lightning's SLURM requeue (SIGUSR1) saves these in the run directory


def resume_checkpoint(trainer: L.Trainer) -> str | None:
    """The checkpoint this fit resumes, None for a fresh fit.

    Lightning sets ``trainer.ckpt_path`` only when it restores the checkpoint: after the module's ``setup``, and under
    DeepSpeed only after ``strategy.setup``; the flowkit CLI's trainer knows it from ``fit``'s argument on.
    """
    return trainer.ckpt_path or getattr(trainer, "requested_ckpt_path", None)


def newest_checkpoint(run_dir: Path, checkpoint_dirs: list[Path]) -> Path | None:
    """The newest of the run's ``last*.ckpt`` (in ``checkpoint_dirs``) and ``hpc_ckpt_N.ckpt`` (in ``run_dir``), by
    the time it was saved (Lightning's own ``last`` takes the newest ``last*.ckpt`` and never an hpc checkpoint)."""
    candidates = [path for directory in checkpoint_dirs if directory.is_dir() for path in directory.glob("last*.ckpt")]
    if run_dir.is_dir():
        candidates += run_dir.glob(HPC_CHECKPOINT_GLOB)
    return max(candidates, key=_saved_at, default=None)


def _saved_at(path: Path) -> int:
    # DeepSpeed rewrites a checkpoint directory's `latest` file at every save; the directory's own time stays.
    try:
        return (path / "latest" if path.is_dir() else path).stat().st_mtime_ns
    except OSError:
        return -1


def requeued_slurm_job() -> bool:
    """This process is a SLURM job step that ran before: requeued by Lightning's SIGUSR1 handler (``scontrol
    requeue``) or by SLURM after a pre-emption (``--requeue``), which count ``SLURM_RESTART_COUNT`` up."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect() and int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0


def checkpoint_metadata(path: Path) -> dict[str, Any] | None:
    """A Lightning checkpoint's contents without its weights' data (memory-mapped), for checks before a resume;
    None when the file cannot be read (the resume itself then falls back to the checkpoint before it).

    A DeepSpeed checkpoint directory: its client state (rank 0's ``*model_states.pt``, which Lightning fills with
    everything but the sharded weights and optimizer).
    Raises :class:`~flowkit.errors.ConfigError` for a file that is no Lightning checkpoint.
    """
    if path.is_dir():
        tag = (path / "latest").read_text().strip() if (path / "latest").is_file() else None
        # mp_rank_00_model_states.pt (ZeRO-2), or rank 0's zero_pp_rank_0_mp_rank_00_model_states.pt (ZeRO-3)
        states = next(iter(sorted((path / tag).glob("*model_states.pt"))), None) if tag else None
        if states is None:
            raise ConfigError(f"--ckpt_path {path} is a directory but no DeepSpeed checkpoint (no 'latest' file "
                              "naming its model states)")
        return torch.load(states, map_location="cpu", weights_only=True, mmap=True)
    if path.is_file() and _is_safetensors(path):  # torch.load reads these too, as a plain dict of tensors
        raise ConfigError(f"--ckpt_path {path} is a safetensors file (weights only), not a Lightning checkpoint; "
                          "resume from the run's checkpoints/last.ckpt")
    try:
        metadata = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        if unreadable_checkpoint(err) is None:
            raise
        return None
    if not isinstance(metadata, dict) or "pytorch-lightning_version" not in metadata:
        what = ("the state of an offline flow pretraining, which a fit without --ckpt_path continues"
                if isinstance(metadata, dict) and "steps_done" in metadata else "not a training checkpoint")
        raise ConfigError(f"--ckpt_path {path} is no Lightning checkpoint ({what}); resume from the run's "
                          "checkpoints/last.ckpt")
    return metadata


def _is_safetensors(path: Path) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then that many bytes of JSON."""
    with path.open("rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


class ResumeInPlace(L.Callback):
    """A resumed run keeps saving into its own ``last.ckpt``, also after its directory moved (``mv runs/A runs/B``);
    a checkpoint records whether the fit had written its export (:data:`EXPORTED_KEY`) when it was saved.

    ModelCheckpoint restores the path of the last checkpoint only when the checkpoint directory is the one it was
    saved from; otherwise it finds ``last.ckpt`` present but not its own and writes ``last-v1.ckpt`` beside it.
    """

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[EXPORTED_KEY] = any(getattr(callback, "exported", False) for callback in trainer.callbacks)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if resume_checkpoint(trainer) is None:
            return
        for callback in trainer.checkpoint_callbacks:
            if not isinstance(callback, ModelCheckpoint) or not callback.dirpath or not callback.save_last:
                continue
            own = Path(callback.dirpath) / (callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
            if own.exists() and Path(callback.last_model_path or "").parent.resolve() != own.parent.resolve():
                callback.last_model_path = str(own)


LOCK_NAME = ".flowkit.lock"
# Set by launchers (torchrun, Lightning's own, SLURM, MPI) for a process that is one rank of a multi-process job.
_RANK_VARIABLES = ("RANK", "GROUP_RANK", "NODE_RANK", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                   "JSM_NAMESPACE_RANK")


class RunDirectoryLock:
    """An exclusive ``fcntl`` lock on ``<run dir>/.flowkit.lock``, held until :meth:`release` or the process ends."""

    def __init__(self, fd: int):
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the lock
            self._fd = None


def lock_run_directory(run_dir: str | Path) -> RunDirectoryLock | None:
    """Lock ``run_dir`` for this run, or raise :class:`~flowkit.errors.RunError` naming the process holding it.

    Only a job's global rank 0 locks; a process the environment marks as another rank (``RANK``, ``LOCAL_RANK``,
    ``NODE_RANK``, ``SLURM_PROCID``, ... not 0: the ranks Lightning launches re-run the command) returns ``None``, so
    the ranks of one job never refuse each other. The kernel drops the lock when its process ends, however it ends,
    so the lock file a killed run leaves behind blocks nothing; the file stays (deleting it would race with a run
    that is starting).
    """
    if any(os.environ.get(name, "0").strip() != "0" for name in _RANK_VARIABLES):
        return None
    run_dir = Path(run_dir)
    path = run_dir / LOCK_NAME
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # Never through a link (O_NOFOLLOW), and only a regular file of its own: a lock file is reused across runs
        # (so not O_EXCL), but one that is a symlink, a hard link to another file or no file at all is refused
        # before anything is written into it.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _planted(path, "the run's lock file belongs") from None
        raise RunError(f"cannot use {run_dir} as the run directory: {_directory_problem(run_dir, err)}; give the run "
                       "another --trainer.default_root_dir") from None
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:
        os.close(fd)
        raise _planted(path, "the run's lock file belongs") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "a process"
        os.close(fd)
        raise RunError(f"{run_dir} is in use by another run ({holder}, see {path}): wait for it to end, or give this "
                       "run its own --trainer.default_root_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return RunDirectoryLock(fd)


def _directory_problem(run_dir: Path, err: OSError) -> str:
    """Why ``run_dir`` cannot hold a run, in a few words (the OS error's, and which part of the path is at fault)."""
    if err.errno == errno.ENAMETOOLONG:
        longest = max(run_dir.parts, key=len)
        return f"a name in the path is longer than the filesystem allows ({len(longest)} characters: {longest[:40]}...)"
    if err.errno in (errno.EEXIST, errno.ENOTDIR):
        blocking = next((p for p in [*reversed(run_dir.parents), run_dir] if p.exists() and not p.is_dir()), run_dir)
        return f"{blocking} is a file, not a directory"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"it is not writable ({err.strerror})"
    return err.strerror or str(err)


def fault_tolerance_defaults() -> dict[str, Any]:
    """Trainer defaults the ``flowkit`` CLI sets: atomic checkpoint files, RNG states, SIGTERM checkpoint."""
    # The plugin as a class_path (unlike the callbacks it is a parser default, and lands in config.yaml).
    plugin = {"class_path": f"{AtomicCheckpointIO.__module__}.{AtomicCheckpointIO.__qualname__}"}
    return {"plugins": [plugin], "callbacks": [RNGStateCheckpoint(), PreemptionCheckpoint(), ResumeInPlace()]}


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
