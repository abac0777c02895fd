"""`flowkit plot RUN_DIR`: a run's training curves from its ``metrics.csv`` as one PNG.

Six panels: outcome reward (and each reward function's mean), accuracy (training and held-out pass@k), reward
model (the flow's nonzero and accepted fractions and any reward model's ``reward_model/*`` metrics; the flow-reward
and token-reward means on the right axis), loss (policy; flow on the
right axis), entropy, response length.
``RUN_DIR`` is a run directory (``trainer.default_root_dir``: its ``version_*`` directories are read in order, a
resumed version's rows replacing the steps it replayed) or one version directory. Needs matplotlib
(``pip install 'flowkit[bench]'``)::

    flowkit plot runs/rlfr_tiny                 # → runs/rlfr_tiny/curves.png
    flowkit plot runs/rlfr_tiny --out curves.png --smooth 10

Scripts use :func:`plot_run` directly.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import math
import sys
from collections.abc import Iterator
from pathlib import Path

from flowkit.registry import standalone

# (panel title, metrics on the left axis, metrics on a right axis of their own scale); a metric is a logged name or
# an fnmatch pattern over the logged names.
PANELS: list[tuple[str, list[str], list[str]]] = [
    ("outcome reward", ["train/outcome_reward", "train/reward/*"], []),
    ("accuracy", ["train/accuracy", "val/*/pass@*"], []),
    ("reward model", ["flow/reward_nonzero_frac", "flow/accepted_frac", "reward_model/*"],
     ["flow/reward_mean", "train/token_reward/mean"]),
    ("loss", ["train/policy_loss"], ["flow/loss"]),
    ("entropy", ["train/entropy"], []),
    ("response length", ["train/response_length"], []),
]
Series = dict[str, dict[int, float]]  # metric → step → value


def metrics_files(run_dir: str | Path) -> list[Path]:
    """The run's ``metrics.csv`` files, oldest version first."""
    run_dir = Path(run_dir)
    if (run_dir / "metrics.csv").is_file():
        return [run_dir / "metrics.csv"]
    versions = [p for p in run_dir.glob("version_*/metrics.csv") if p.parent.name.removeprefix("version_").isdigit()]
    return sorted(versions, key=lambda p: int(p.parent.name.removeprefix("version_")))


class MetricsFileError(ValueError):
    """A ``metrics.csv`` that is not the table Lightning's CSVLogger writes; the message names the file and line."""


def read_metrics(run_dir: str | Path) -> Series:
    """Every logged metric of the run by step; a later version's value of a step replaces an earlier one's.
    Non-finite values (``flow/loss`` is NaN on steps without a flow update) are left out. A damaged file is a
    :class:`MetricsFileError` (:func:`metrics_rows`)."""
    files = metrics_files(run_dir)
    if not files:
        raise FileNotFoundError(f"{run_dir}: no metrics.csv (looked in it and in its version_* directories)")
    series: Series = {}
    for path in files:
        for step, values in metrics_rows(path):
            for name, value in values.items():
                if name != "epoch" and math.isfinite(value):
                    series.setdefault(name, {})[step] = value
    return series


def metrics_rows(path: Path) -> Iterator[tuple[int, dict[str, float]]]:
    """``(step, {metric: value})`` of each row of ``path``, empty cells left out. Checked as it is read: a header
    naming ``step`` once and no column twice, rows as long as it, an integer step and numbers in every other cell.
    A last line cut short with no newline after it (the logger is writing it) is left out."""
    try:
        text = path.read_text(encoding="utf-8")
        lines = list(csv.reader(io.StringIO(text, newline="")))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise MetricsFileError(f"{path}: not a readable CSV file ({type(err).__name__}: {err})") from None
    if not lines:
        raise MetricsFileError(f"{path}: empty (no header row)")
    header = lines[0]
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated or "step" not in header:
        problem = f"names {', '.join(map(repr, repeated))} more than once" if repeated else "has no 'step' column"
        raise MetricsFileError(f"{path}:1: the header {problem}: {','.join(header)[:80]!r}")
    for number, cells in enumerate(lines[1:], start=2):
        if len(cells) != len(header):
            if number == len(lines) and len(cells) < len(header) and not text.endswith("\n"):
                continue  # being written
            raise MetricsFileError(f"{path}:{number}: {len(cells)} cells where the header has {len(header)}")
        row = dict(zip(header, cells))
        step = row.pop("step")
        if not step.strip().lstrip("-").isdigit():
            raise MetricsFileError(f"{path}:{number}: step {step[:40]!r} is not an integer")
        yield int(step), {name: _number(value, path, number, name) for name, value in row.items() if value != ""}


def _number(value: str, path: Path, line: int, column: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise MetricsFileError(f"{path}:{line}: {column} {value[:40]!r} is not a number") from None


def plot_run(run_dir: str | Path, out: str | Path | None = None, smooth: int = 1, title: str | None = None) -> Path:
    """Draw the run's curves (:func:`draw_curves`) and write the PNG (default ``RUN_DIR/curves.png``)."""
    series = read_metrics(run_dir)  # before matplotlib loads: a damaged file is reported at once
    plt = _pyplot()
    figure = draw_curves(series, smooth, title or str(run_dir))
    out = Path(out) if out is not None else Path(run_dir) / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def draw_curves(series: Series, smooth: int = 1, title: str = ""):
    """A matplotlib figure with the six panels of :data:`PANELS` (a panel whose metrics were not logged says so).

    ``smooth`` > 1 overlays a trailing moving average of that many logged points on each training curve.
    """
    plt = _pyplot()
    figure, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)
    for ax, (panel, left, right) in zip(axes.flat, PANELS):
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        handles = _draw(ax, series, left, smooth, colors)
        right_names = _matching(series, right)
        if right_names:
            twin = ax.twinx()
            handles += _draw(twin, series, right, smooth, colors, linestyle="--")
            twin.set_ylabel(", ".join(right_names), fontsize=8)
        if handles:
            ax.legend(handles=handles, fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    figure.suptitle(title)
    return figure


def _pyplot():
    try:
        import matplotlib.pyplot as plt  # headless machines get the Agg backend by default
    except ImportError:
        raise SystemExit("flowkit plot needs matplotlib: pip install 'flowkit[bench]' (or matplotlib)") from None
    return plt


def _matching(series: Series, patterns: list[str]) -> list[str]:
    return [n for n in sorted(series) if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _draw(ax, series: Series, patterns: list[str], smooth: int, colors, linestyle: str = "-") -> list:
    """Plot the matching metrics on ``ax`` (raw, plus a moving average when ``smooth`` > 1); their legend handles."""
    handles = []
    for name in _matching(series, patterns):
        steps = sorted(series[name])
        values = [series[name][s] for s in steps]
        color, averaged = next(colors), smooth > 1 and not name.startswith("val/") and len(values) > smooth
        marker = "o" if len(steps) <= 20 or name.startswith("val/") else None
        line, = ax.plot(steps, values, marker=marker, markersize=3, linewidth=1, linestyle=linestyle, color=color,
                        alpha=0.4 if averaged else 1.0, label=name)
        if averaged:
            ax.plot(steps, _moving_average(values, smooth), color=color, linewidth=2, linestyle=linestyle)
        handles.append(line)
    return handles


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points."""
    averaged, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        averaged.append(total / min(i + 1, window))
    return averaged


@standalone("plot")
def plot_command(argv: list[str]) -> None:
    """draw a run's training curves (metrics.csv) into a PNG: flowkit plot RUN_DIR [--out PNG] [--smooth N]"""
    parser = argparse.ArgumentParser(prog="flowkit plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="run directory (trainer.default_root_dir) or one of its version_* directories")
    parser.add_argument("--out", default=None, help="PNG to write (default: RUN_DIR/curves.png)")
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window over logged points (1 = off)")
    parser.add_argument("--title", default=None, help="figure title (default: RUN_DIR)")
    options = parser.parse_args(argv)
    try:
        path = plot_run(options.run_dir, options.out, options.smooth, options.title)
    except (FileNotFoundError, MetricsFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {path}")
