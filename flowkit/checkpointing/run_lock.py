"""One run at a time in a run directory: an exclusive lock file, opened without following links."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from pathlib import Path

from flowkit.checkpointing.atomic_files import _planted
from flowkit.errors import RunError

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
