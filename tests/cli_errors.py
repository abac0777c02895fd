"""Test helper: run the ``flowkit`` command in a subprocess, as a user meets it, optionally under resource limits (or
in this process, for a test's further cases), and check that it ended with its one-line error."""

from __future__ import annotations

import logging
import resource
import signal
import subprocess
import sys
from pathlib import Path

import rlfr_run


def run_flowkit(cwd: Path, args: list[str], address_space: int | None = None, file_size: int | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
    """``flowkit ARGS`` in ``cwd``; ``address_space`` / ``file_size`` (bytes) cap its virtual memory / any file it
    writes (a write past ``file_size`` then fails with EFBIG, as a full disk fails with ENOSPC)."""

    def limits() -> None:
        if address_space is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        if file_size is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process being killed
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(args, cwd=cwd, env=rlfr_run.env(), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limits, check=False)


def run_flowkit_in_process(cwd: Path, args: list[str], capsys, monkeypatch) -> subprocess.CompletedProcess:
    """``flowkit ARGS`` (``args[0]`` the command's name) through :func:`flowkit.cli.main` in this process, in
    ``cwd``: what :func:`run_flowkit` returns without a second start-up of torch and Lightning, for a test that checks
    several errors and sends one of them through the console script."""
    from flowkit.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main appends the working directory
    # A console handler (Lightning's) keeps the stderr of the test that first imported its library, closed since: this
    # call's stderr instead, as in a process of its own
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for handler in (handler for logger in loggers for handler in getattr(logger, "handlers", ())):  # not placeholders
        if type(handler) is logging.StreamHandler:
            monkeypatch.setattr(handler, "stream", sys.stderr)
    capsys.readouterr()
    try:
        main(args[1:])
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def fit(cwd: Path, steps: int, *extra: str, **limits) -> subprocess.CompletedProcess:
    """The shrunk tiny RLFR job (:mod:`rlfr_run`) in ``cwd/runs/rlfr_tiny``, without validation."""
    return run_flowkit(cwd, rlfr_run.command(cwd, steps, "--data.init_args.val_path", "null", *extra), **limits)


def fit_in_process(cwd: Path, steps: int, *extra: str, capsys, monkeypatch) -> subprocess.CompletedProcess:
    """:func:`fit` through :func:`run_flowkit_in_process`."""
    command = rlfr_run.command(cwd, steps, "--data.init_args.val_path", "null", *extra)
    return run_flowkit_in_process(cwd, command, capsys, monkeypatch)


def one_line_error(result: subprocess.CompletedProcess, max_lines: int | None = 3) -> str:
    """The error of a run that must fail as bad input: exit code 2, no traceback, one ``error:`` line and it the last,
    at most ``max_lines`` lines on stderr in all (None: a failure once training runs follows Lightning's start-up
    lines, which are not counted)."""
    lines = result.stderr.rstrip("\n").split("\n")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, result.stderr
    assert max_lines is None or len(lines) <= max_lines, result.stderr
    return lines[-1]


def address_space_limit() -> int:
    """A cap on a flowkit process's virtual memory: this test process's (which imported the same libraries) plus
    1 GiB, within [2, 8] GiB. Loading the tiny job takes about 1 GiB; tokenizing a 64 MB field takes well over 8."""
    status = Path("/proc/self/status").read_text()
    size_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmSize:"))
    return min(8 << 30, max(2 << 30, size_kb * 1024 + (1 << 30)))
