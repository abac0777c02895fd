"""Draws one PNG per (benchmark, device, size) from benchmarks/results/results.csv: median time per implementation
with p20–p80 error bars, from the latest run that measured that case (rows written before run ids existed: the
latest row of each implementation). Usage: python benchmarks/plot.py [--csv X] [--out DIR]"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from common import RESULTS_CSV


def latest_rows(path: Path) -> dict:
    """{(benchmark, device, dtype, size, mode): {implementation: row}} from each case's latest run."""
    cases: dict = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if not row.get("median_ms"):  # e.g. the copy-bandwidth reference rows
                continue
            key = tuple(row.get(k) or "" for k in ("benchmark", "device", "dtype", "size", "mode"))
            cases.setdefault(key, []).append(row)
    groups = {}
    for key, rows in cases.items():
        latest_run = max(row.get("run") or "" for row in rows)
        groups[key] = {label(row): row for row in rows if (row.get("run") or "") == latest_run}
    return groups


def label(row: dict) -> str:
    """The implementation, with its row budget when it scored through flowkit's chunks (``max_rows`` 0 = one call;
    the naive loops have no budget)."""
    name = row.get("implementation") or row.get("impl") or "?"
    rows = row.get("max_rows")
    if not rows or name.startswith("naive"):
        return name
    return f"{name}\none call" if rows == "0" else f"{name}\n≤{rows} rows"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--csv", default=str(RESULTS_CSV))
    parser.add_argument("--out", default=str(Path(RESULTS_CSV).parent))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for (bench, device, dtype, size, mode), rows in latest_rows(Path(args.csv)).items():
        names = list(rows)
        median = [float(rows[n]["median_ms"]) for n in names]
        low = [m - float(rows[n]["p20_ms"]) for m, n in zip(median, names)]
        high = [float(rows[n]["p80_ms"]) - m for m, n in zip(median, names)]
        fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(names), 3.2))
        ax.bar(names, median, yerr=[low, high], capsize=4, color="tab:blue")
        ax.set_ylabel("median ms (p20–p80)")
        title = " ".join(filter(None, [bench, mode, device, dtype]))
        ax.set_title(f"{title}\n{size}", fontsize=9)
        fig.tight_layout()
        name = "_".join(filter(None, [bench, mode, device, dtype, size])) + ".png"
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        print(out / name)
    plot_rl_memory(Path(args.csv), out)


def plot_rl_memory(path: Path, out: Path) -> None:
    """bench_rl_memory: peak RSS against the rollouts-per-step scale, one line per (mode, malloc) from its latest run."""
    lines: dict = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if row.get("benchmark") == "rl_memory" and row.get("peak_rss_mb"):
                lines.setdefault((row.get("mode") or "", row.get("malloc") or "glibc default"), []).append(row)
    if not lines:
        return
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for (mode, malloc), rows in lines.items():
        latest_run = max(row.get("run") or "" for row in rows)
        points = sorted((int(row["scale"]), float(row["peak_rss_mb"])) for row in rows if (row.get("run") or "") == latest_run)
        ax.plot(*zip(*points), marker="o", label=f"{mode}, {malloc}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rollouts per step (x the smallest)")
    ax.set_ylabel("peak RSS of the step's process (MiB)")
    ax.set_title("rl_memory: peak RSS of one RL step as the rollouts per step grow", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "rl_memory.png", dpi=120)
    plt.close(fig)
    print(out / "rl_memory.png")


if __name__ == "__main__":
    main()
