"""Atomic checkpoint files: written beside the target, fsynced, ``os.replace``-d over it; the replaced one kept.

:class:`AtomicCheckpointIO` writes a checkpoint to a temporary file in the target's own directory, fsyncs it and
``os.replace``-s it over the target: a kill at any moment leaves either the old or the new checkpoint, never a
truncated one. (Lightning's default writes through an fsspec transaction whose temporary file lives in the system
temp dir; when that is another filesystem the final move is a copy, which a kill can interrupt.) It keeps the
checkpoint a save replaces as ``<name>.previous`` and resumes from that one when the checkpoint itself cannot be
read; a failed write (a full disk) is one line. Every temporary is opened without following links.
"""

from __future__ import annotations

import glob
import logging
import os
import pickle
import shutil
import socket
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from flowkit.errors import RunError

log = logging.getLogger(__name__)

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
