"""`flowkit export` as a user runs it: an output directory that holds what the export reads is refused in one line,
before anything is touched."""

from pathlib import Path

import cli_errors

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "grpo_tiny.yaml"


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every directory (None) under ``root``."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_export_never_replaces_its_checkpoint_run_or_working_directory(tmp_path, capsys, monkeypatch):
    """The first case through the console script as a user meets it, the others in this process (the same
    :func:`flowkit.cli.main`, without a start-up of torch and Lightning each)."""
    work, run = tmp_path / "work", tmp_path / "work" / "runs" / "grpo"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"the trained weights")  # refused before it is read
    (run / "version_0").mkdir()
    (run / "version_0" / "metrics.csv").write_text("step,train/accuracy\n1,0.5\n")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "other.ckpt").write_bytes(b"weights of another run")
    before = tree(tmp_path)
    in_run, other = "runs/grpo/checkpoints/last.ckpt", str(tmp_path / "kept" / "other.ckpt")
    cases = [
        (in_run, "runs/grpo", f"holds the checkpoint ({run / 'checkpoints' / 'last.ckpt'}), which the export would "
                              "replace: choose a directory of its own, e.g. --out runs/grpo/export"),
        (in_run, "runs/grpo/version_0/..", "holds the checkpoint"),
        (in_run, f"{in_run}/out", f"is inside the checkpoint {run / 'checkpoints' / 'last.ckpt'}"),
        (other, "runs/grpo", f"holds the run directory ({run})"),
        (other, ".", f"holds the working directory ({work})"),
    ]
    for i, (checkpoint, out, expected) in enumerate(cases):
        args = ["flowkit", "export", "--config", str(CONFIG), "--checkpoint", checkpoint,
                "--trainer.default_root_dir", "runs/grpo", "--out", out, "--overwrite", "true"]
        result = cli_errors.run_flowkit(work, args) if i == 0 else \
            cli_errors.run_flowkit_in_process(work, args, capsys, monkeypatch)
        line = cli_errors.one_line_error(result, max_lines=None)
        assert line.startswith(f"error: --out {out!r} ") and expected in line, line
        assert tree(tmp_path) == before, out  # nothing written, nothing removed, no staging directory
