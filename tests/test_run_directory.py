"""The run directory (issue 34): files flowkit creates there are never written through a link someone planted
(``O_NOFOLLOW``; checkpoint temporaries also ``O_EXCL``), and a run directory that cannot be one (read-only, a file,
a name too long) is a one-line error, as is data a user meets there: a NaN answer, an eval set named with a dot."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import cli_errors
import pytest
import rlfr_run
import torch

from flowkit.checkpointing.atomic_files import AtomicCheckpointIO, PlantedFileError, _temporary_path
from flowkit.checkpointing.run_lock import LOCK_NAME, lock_run_directory

SECRET = "must stay as it is\n"


def planted_target(tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_text(SECRET)
    return target


def test_a_symlink_planted_at_the_lock_is_a_one_line_error_and_its_target_untouched(tmp_path):
    """The lock used to be opened following links and truncated: the linked file became `process 18197 on vm`."""
    target = planted_target(tmp_path)
    run_dir = tmp_path / "runs" / "rlfr_tiny"
    run_dir.mkdir(parents=True)
    (run_dir / LOCK_NAME).symlink_to(target)
    result = cli_errors.fit(tmp_path, 1)
    assert cli_errors.one_line_error(result) == (
        f"error: refusing to write {run_dir / LOCK_NAME}: a symlink is there, where the run's lock file belongs "
        "(planted by someone who can write in the run directory?); nothing was written through it: remove it and run "
        "again")
    assert target.read_text() == SECRET


def test_a_hard_link_planted_at_the_lock_is_refused_before_anything_is_written(tmp_path):
    target = planted_target(tmp_path)
    os.link(target, tmp_path / LOCK_NAME)
    with pytest.raises(PlantedFileError, match="a file is there, where the run's lock file belongs"):
        lock_run_directory(tmp_path)
    assert target.read_text() == SECRET


@pytest.mark.parametrize("planted", ["temporary", "previous"])
def test_a_symlink_planted_at_a_checkpoint_temporary_is_refused_and_last_ckpt_stays_a_file(tmp_path, planted):
    """The temporary `.<name>.<host>.<pid>.tmp` (named by the writing process, so planted here in-process) used to be
    opened following links: the link's target was overwritten with checkpoint bytes and last.ckpt became a link to
    it. Same for the staged `.previous` hard link."""
    target = planted_target(tmp_path)
    io = AtomicCheckpointIO()
    last = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"global_step": 1}, last)
    staged = _temporary_path(last if planted == "temporary" else last.with_name("last.ckpt.previous"))
    staged.symlink_to(target)
    with pytest.raises(PlantedFileError) as refused:
        io.save_checkpoint({"global_step": 2}, last)
    assert str(refused.value) == (
        f"refusing to write {staged}: a symlink is there, where flowkit creates its own new file (planted by someone "
        "who can write in the run directory?); nothing was written through it: remove it and run again")
    assert target.read_text() == SECRET
    assert not last.is_symlink() and torch.load(last, weights_only=True)["global_step"] == 1
    assert staged.is_symlink()  # left for the user to inspect: flowkit removes only files it created


def test_a_symlink_at_last_ckpt_itself_is_replaced_not_written_through(tmp_path):
    target = planted_target(tmp_path)
    last = tmp_path / "last.ckpt"
    last.symlink_to(target)
    AtomicCheckpointIO().save_checkpoint({"global_step": 3}, last)
    assert target.read_text() == SECRET
    assert not last.is_symlink() and torch.load(last, weights_only=True)["global_step"] == 3
    assert not last.with_name("last.ckpt.previous").exists()  # a link is no previous checkpoint to keep


@contextlib.contextmanager
def read_only_directory(path: Path):
    """``path`` made read-only: by its mode for a user, by a read-only bind mount for root (whom modes do not stop)."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)], capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot make a read-only directory as root here: {mounted.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", str(path)], check=False, capture_output=True)


@pytest.mark.parametrize("case", ["read-only", "a file", "a long name"])
def test_a_run_directory_that_cannot_be_one_is_a_one_line_error(tmp_path, case, capsys, monkeypatch):
    """These used to be raw `OSError` / `FileExistsError` tracebacks. ``a file`` through the console script as a user
    meets it, the others in this process (the same :func:`flowkit.cli.main`)."""
    if case == "a long name":
        run_dir = tmp_path / ("r" * 300)
        problem = "a name in the path is longer than the filesystem allows (300 characters: " + "r" * 40 + "...)"
    elif case == "a file":
        (tmp_path / "runs").write_text("not a directory\n")
        run_dir = tmp_path / "runs" / "rlfr_tiny"
        problem = f"{tmp_path / 'runs'} is a file, not a directory"
    else:
        run_dir = tmp_path / "readonly" / "rlfr_tiny"
        problem = "it is not writable (Read-only file system)" if os.geteuid() == 0 else \
            "it is not writable (Permission denied)"
    with read_only_directory(tmp_path / "readonly") if case == "read-only" else contextlib.nullcontext():
        args = (tmp_path, 1, "--trainer.default_root_dir", str(run_dir))
        result = cli_errors.fit(*args) if case == "a file" else \
            cli_errors.fit_in_process(*args, capsys=capsys, monkeypatch=monkeypatch)
    assert cli_errors.one_line_error(result) == (
        f"error: cannot use {run_dir} as the run directory: {problem}; give the run another --trainer.default_root_dir")


def test_a_nan_answer_is_refused_like_null(tmp_path):
    """`"answer": NaN` (valid to Python's JSON reader, and pandas' missing value) used to train as the answer "nan"."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": NaN}\n')
    result = cli_errors.fit(tmp_path, 1, "--data.init_args.train_path", str(data))
    assert cli_errors.one_line_error(result) == (
        f"error: {data}:2: required field 'answer' is empty (nan, a missing value)")


@pytest.mark.slow  # a step and a validation through the CLI
def test_an_eval_set_named_with_a_dot_validates_and_exports(tmp_path):
    """`gsm8k.test` used to train, then fail at validation (`KeyError: module name can't contain "."`), no export."""
    result = rlfr_run.run(tmp_path, 1, "--data.init_args.val_path", "null", "--data.init_args.eval_paths",
                          "{gsm8k.test: bundled:arithmetic/val.jsonl}", "--data.init_args.max_val_examples", "4",
                          "--model.init_args.validation.num_samples", "1", "--trainer.val_check_interval", "1")
    version = rlfr_run.version_dirs(tmp_path)[-1]
    logged = {key for values in rlfr_run.metrics(version).values() for key in values}
    assert "val/gsm8k.test/pass@1" in logged, (sorted(logged), result.stderr[-2000:])
    assert (version / "export" / "hf_policy").is_dir()


def test_a_temporary_left_by_a_killed_writer_with_this_process_id_does_not_block_the_save(tmp_path):
    """In a container a restarted job often gets the killed one's process id, hence its temporary file names."""
    last = tmp_path / "last.ckpt"
    _temporary_path(last).write_bytes(b"half a checkpoint")
    AtomicCheckpointIO().save_checkpoint({"global_step": 4}, last)
    assert torch.load(last, weights_only=True)["global_step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
