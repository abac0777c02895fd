"""`flowkit plot RUN_DIR`: the training curves of a run's metrics.csv files as one PNG with six panels."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowkit.cli import main
from flowkit.commands.plot import PANELS, draw_curves, read_metrics

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["epoch", "step", "train/outcome_reward", "train/accuracy", "train/reward/boxed_format_reward",
           "flow/reward_nonzero_frac", "flow/reward_mean", "flow/loss", "train/policy_loss", "train/entropy",
           "train/response_length", "val/heldout/pass@1"]


def write_metrics(directory: Path, steps: range, offset: float = 0.0, val_at: int | None = None) -> None:
    """metrics.csv as Lightning's CSVLogger writes it: one row per step, a validation row of its own."""
    directory.mkdir(parents=True)
    with (directory / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for step in steps:
            writer.writerow({"epoch": 0, "step": step, "train/outcome_reward": 0.4 + 0.01 * step + offset,
                             "train/accuracy": 0.3 + 0.01 * step, "train/reward/boxed_format_reward": 0.9,
                             "flow/reward_nonzero_frac": 0.2, "flow/reward_mean": -0.001,
                             "flow/loss": "nan" if step % 2 else 0.5, "train/policy_loss": 0.01,
                             "train/entropy": 0.25, "train/response_length": 24})
        if val_at is not None:
            writer.writerow({"epoch": 0, "step": val_at, "val/heldout/pass@1": 0.6})


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run interrupted after step 5 and resumed from its step-4 checkpoint (steps 4 and 5 are replayed)."""
    run = tmp_path / "runs" / "demo"
    write_metrics(run / "version_0", range(0, 6))
    write_metrics(run / "version_1", range(4, 10), offset=0.5, val_at=9)
    return run


def test_versions_are_merged_and_the_resumed_values_win(run_dir):
    series = read_metrics(run_dir)
    assert sorted(series["train/outcome_reward"]) == list(range(10))
    assert series["train/outcome_reward"][3] == pytest.approx(0.43)  # only in version_0
    assert series["train/outcome_reward"][5] == pytest.approx(0.95)  # replayed after the resume: version_1's
    assert series["val/heldout/pass@1"] == {9: 0.6}
    assert sorted(series["flow/loss"]) == [0, 2, 4, 6, 8]  # NaN (no flow update that step) is left out
    assert "epoch" not in series
    assert read_metrics(run_dir / "version_0")["train/outcome_reward"][5] == pytest.approx(0.45)  # one version


def test_figure_has_the_six_panels_and_says_what_was_not_logged(run_dir):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    series = read_metrics(run_dir)
    del series["train/entropy"]
    figure = draw_curves(series, smooth=3)
    titled = [ax for ax in figure.axes if ax.get_title()]
    assert [ax.get_title() for ax in titled] == [title for title, _, _ in PANELS] == [
        "outcome reward", "accuracy", "reward model", "loss", "entropy", "response length"]
    labels = {ax.get_title(): [line.get_label() for line in ax.get_legend().get_lines()] if ax.get_legend() else []
              for ax in titled}
    assert labels["outcome reward"] == ["train/outcome_reward", "train/reward/boxed_format_reward"]
    assert labels["accuracy"] == ["train/accuracy", "val/heldout/pass@1"]
    assert labels["reward model"] == ["flow/reward_nonzero_frac", "flow/reward_mean"]  # the mean on a right axis
    assert labels["loss"] == ["train/policy_loss", "flow/loss"]
    entropy = titled[4]
    assert not entropy.lines and [t.get_text() for t in entropy.texts] == ["not logged"]
    reward_lines = titled[0].lines
    assert len(reward_lines) == 4  # raw + moving average for each of the two reward curves
    assert list(reward_lines[0].get_xdata()) == list(range(10))
    plt.close(figure)


def test_flowkit_plot_writes_the_png(run_dir, capsys):
    image = pytest.importorskip("matplotlib.image")
    main(["plot", str(run_dir), "--smooth", "2"])
    out = run_dir / "curves.png"
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    pixels = image.imread(out)
    assert pixels.shape[:2] == (800, 1500)  # 15 × 8 inches at 100 dpi
    assert pixels.std() > 0.05  # something was drawn


def test_flowkit_plot_names_a_directory_without_metrics(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["plot", str(tmp_path)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"error: {tmp_path}: no metrics.csv (looked in it and in its version_* "
                                       "directories)\n")


HEADER = "epoch,step,train/accuracy,train/entropy\r\n"
DAMAGED = {  # what metrics.csv holds → the error's line and what it says
    "truncated-row": (HEADER + "0,1,0.5,0.2\r\n0,2,0.6\r\n0,3,0.7,0.1\r\n", ":3: 3 cells where the header has 4"),
    "non-numeric-cell": (HEADER + "0,1,0.5,0.2\r\n0,2,high,0.1\r\n", ":3: train/accuracy 'high' is not a number"),
    "non-integer-step": (HEADER + "0,1.5,0.5,0.2\r\n", ":2: step '1.5' is not an integer"),
    "missing-header": ("0,1,0.5,0.2\r\n0,2,0.6,0.1\r\n", ":1: the header has no 'step' column: '0,1,0.5,0.2'"),
    "empty-file": ("", ": empty (no header row)"),
    "binary-garbage": (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", ": not a readable CSV file (UnicodeDecodeError: "),
    "nul-bytes": ("step,x\r\n1,\x00\r\n", ":2: x '\\x00' is not a number"),
    "duplicate-columns": ("epoch,step,train/accuracy,train/accuracy\r\n0,1,0.5,0.6\r\n",
                          ":1: the header names 'train/accuracy' more than once"),
    "extra-cells": (HEADER + "0,1,0.5,0.2,0.9\r\n", ":2: 5 cells where the header has 4"),
}


@pytest.mark.parametrize(("content", "expected"), DAMAGED.values(), ids=DAMAGED.keys())
def test_a_damaged_metrics_file_is_one_line_naming_it_and_the_row(tmp_path, content, expected):
    metrics = tmp_path / "run" / "version_0" / "metrics.csv"
    write_metrics(metrics.parent.parent / "version_1", range(3))  # an intact version beside it: the damaged one named
    metrics.parent.mkdir()
    (metrics.write_bytes if isinstance(content, bytes) else metrics.write_text)(content)
    result = subprocess.run([sys.executable, "-m", "flowkit", "plot", str(tmp_path / "run")], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 2 and result.stderr.startswith(f"error: {metrics}{expected}"), result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "run" / "curves.png").exists()


def test_a_last_row_being_written_is_left_out(tmp_path):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text(HEADER + "0,1,0.5,0.2\r\n0,2,0.6,0.1\r\n0,3,0.")  # the logger is writing row 3
    assert read_metrics(tmp_path) == {"train/accuracy": {1: 0.5, 2: 0.6}, "train/entropy": {1: 0.2, 2: 0.1}}
