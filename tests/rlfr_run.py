"""Test helper: run the tiny RLFR config through the ``flowkit`` CLI in a subprocess, shrunk to seconds.

Shrunk: 4 prompts × 4 samples per step, no offline flow pretraining, and a flow update as soon as 2
rollouts are accepted by the entropy criterion (about half of every batch), so the flow trains from
the second step on.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "rlfr_tiny.yaml"
TINY = [
    "--model.init_args.flow_pretrain.steps", "0",
    "--model.init_args.sampling.num_samples", "4",
    "--model.init_args.reward_model.init_args.online.kappa", "2",
    "--model.init_args.reward_model.init_args.online.rejection_metric", "entropy",
    "--data.init_args.batch_size", "4",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]


def env() -> dict[str, str]:
    """The subprocess environment: tests/ importable, DeepSpeed on CPU, one thread per process (runs
    with 2 ranks share 2 cores; oversubscribed OpenMP threads spin and slow a step down many times)."""
    paths = [str(ROOT / "tests"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def command(root: Path, steps: int, *extra: str, subcommand: str = "fit") -> list[str]:
    flowkit = str(Path(sys.executable).parent / "flowkit")  # this interpreter's (the vLLM venv's under its tests)
    return [flowkit, subcommand, "--config", str(CONFIG), *TINY, "--trainer.max_steps", str(steps),
            "--trainer.default_root_dir", str(root / "runs" / "rlfr_tiny"), *extra]


def run(root: Path, steps: int, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(command(root, steps, *extra), env=env(), cwd=root, capture_output=True, text=True,
                            timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def version_dirs(root: Path) -> list[Path]:
    return sorted((root / "runs" / "rlfr_tiny").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))


def metrics(version: Path) -> dict[int, dict[str, str]]:
    """metrics.csv rows by step (a step's values may be spread over several rows)."""
    rows: dict[int, dict[str, str]] = {}
    with (version / "metrics.csv").open() as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            rows.setdefault(step, {}).update({k: v for k, v in row.items() if v != ""})
    return rows
