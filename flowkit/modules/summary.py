"""What a fit prints besides its progress: the model's parameters at the start, the run's result at the end.

The flowkit CLI adds both to every run (:func:`flowkit.cli.place_run`): :class:`ParameterSummary` in place of
Lightning's model summary unless the trainer's ``enable_model_summary`` is off or the config names its own, and
:class:`RunSummary` unless the config names its own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

from flowkit.errors import ConfigError
from flowkit.modules.callbacks import ExportArtifacts

# Logged metrics that measure the model on data it does not train on: PolicyModule's `val/<set>/pass@k`, the
# explanation module's `val/*` and `final/*`, the selector's `eval/*`.
HELD_OUT_PREFIXES = ("val/", "final/", "eval/")
# What a fit over agent episodes reports of them (flowkit.agents.episode_metrics), as the summary names it.
EPISODE_METRICS = {"episodes/success_rate": "success rate", "episodes/turns_mean": "turns per episode",
                   "episodes/tool_error_rate": "tool-call error rate"}


class ParameterSummary(ModelSummary):
    """Lightning's model summary (name, type, parameters and mode of each submodule) without its FLOPs column.

    Lightning counts FLOPs only on a module's ``example_input_array``, which no flowkit module has (its inputs are
    rollouts), so the column and the ``Total FLOPs`` line would read 0.
    """

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *columns)
        rank_zero_info("\n" + "\n".join(line for line in table.splitlines() if not line.endswith("Total Flops")))


class RunSummary(L.Callback):
    """At the end of ``fit``, rank 0 prints what the run achieved and where its files are (the tiny job)::

        fit summary: 60 steps (0 → 60) in 349 s
          val/heldout: pass@1 0.3625, pass@4 0.805
          outcome reward: 0.3055 over steps 1-10, 0.3953 over steps 51-60
          episodes: success rate 0.25 → 0.375, turns per episode 2.1 → 2.4, tool-call error rate 0.1 → 0.05
          skipped steps: 0
          checkpoint: runs/rlfr_tiny/checkpoints/last.ckpt
          export: runs/rlfr_tiny/version_0/export
          metrics: runs/rlfr_tiny/version_0/metrics.csv

    The held-out lines are every logged ``val/``, ``final/`` and ``eval/`` metric of the last evaluation, one line
    per eval set; the outcome reward is the mean of ``reward_metric`` over the first and the last ``window`` steps
    of this fit (fewer when the fit is shorter than ``2 * window`` steps, so the two never overlap), and so are the
    episodes' success rate, turns and tool-call error rate of a fit over agent episodes. A line whose
    numbers a module does not log is left out (the flow, selector and explanation modules have no outcome reward).
    The time counts from the fit's setup (offline flow pretraining included); paths under the working directory
    are shown relative to it.

    Args:
        window: steps averaged at each end of the fit.
        reward_metric: the per-step logged reward compared.
    """

    def __init__(self, window: int = 10, reward_metric: str = "train/outcome_reward"):
        if window < 1:
            raise ConfigError(f"RunSummary.window must be >= 1, got {window}")
        self.window = window
        self.reward_metric = reward_metric
        self._rewards: dict[int, float] = {}
        self._episodes: dict[str, dict[int, float]] = {}
        self._start_step: int | None = None
        self._start_time = 0.0
        self._log_dir: Path | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Before the module's setup, so the time includes offline flow pretraining. `log_dir` is a broadcast: every
        # rank asks here, where all of them run (only rank 0 prints at the end).
        self._rewards, self._episodes, self._start_step, self._start_time = {}, {}, None, time.monotonic()
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_step = trainer.global_step  # after a resume, the restored step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        reward = trainer.callback_metrics.get(self.reward_metric)
        if reward is not None:
            self._rewards[trainer.global_step] = float(reward)
        for key in EPISODE_METRICS.keys() & trainer.callback_metrics.keys():
            self._episodes.setdefault(key, {})[trainer.global_step] = float(trainer.callback_metrics[key])

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            print("\n".join(self.summary_lines(trainer)), flush=True)

    def summary_lines(self, trainer: L.Trainer) -> list[str]:
        start = trainer.global_step if self._start_step is None else self._start_step  # None: nothing left to train
        steps = trainer.global_step - start
        lines = [f"fit summary: {steps} step{'' if steps == 1 else 's'} ({start} → {trainer.global_step}) "
                 f"in {time.monotonic() - self._start_time:.0f} s"]
        lines += [f"  {group}: {values}" for group, values in _held_out(trainer.callback_metrics).items()]
        if self._rewards:
            lines.append(f"  outcome reward: {self._trend(self._rewards)}")
        if self._episodes:
            lines.append("  episodes: " + ", ".join(f"{name} {self._trend(self._episodes[key], arrow=True)}"
                                                     for key, name in EPISODE_METRICS.items() if key in self._episodes))
        if "train/skipped_steps" in trainer.callback_metrics:
            lines.append(f"  skipped steps: {int(trainer.callback_metrics['train/skipped_steps'])}")
        for checkpoint in trainer.checkpoint_callbacks:
            path = getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")
            if path:
                lines.append(f"  checkpoint: {_shown(path)}")
        for callback in trainer.callbacks:
            if isinstance(callback, ExportArtifacts) and (self._log_dir / callback.subdir).is_dir():
                lines.append(f"  export: {_shown(self._log_dir / callback.subdir)}")
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                logger.save()  # what is still buffered (it flushes every 100 steps otherwise)
                if Path(logger.experiment.metrics_file_path).is_file():  # a fit that logged nothing wrote none
                    lines.append(f"  metrics: {_shown(logger.experiment.metrics_file_path)}")
            else:
                lines.append(f"  logs ({type(logger).__name__}): {_shown(logger.log_dir or logger.save_dir)}")
        return lines

    def _trend(self, values: dict[int, float], arrow: bool = False) -> str:
        """The mean of ``values`` over the first and the last ``window`` steps (``arrow``: ``a → b`` alone)."""
        steps = sorted(values)
        if len(steps) == 1:
            return f"{values[steps[0]]:.4g}" + ("" if arrow else f" at step {steps[0]}")
        n = min(self.window, len(steps) // 2)
        first, last = steps[:n], steps[-n:]
        if arrow:
            return f"{_mean(values, first):.4g} → {_mean(values, last):.4g}"
        return f"{_mean(values, first):.4g} over {_span(first)}, {_mean(values, last):.4g} over {_span(last)}"


def _held_out(metrics: dict[str, Any]) -> dict[str, str]:
    """The held-out metrics among ``metrics``, one entry per eval set:
    ``{"val/heldout/pass@1": 0.34, "val/heldout/pass@4": 0.62}`` → ``{"val/heldout": "pass@1 0.34, pass@4 0.62"}``."""
    groups: dict[str, list[str]] = {}
    for key in sorted(metrics):
        if key.startswith(HELD_OUT_PREFIXES):
            group, _, name = key.rpartition("/")
            groups.setdefault(group, []).append(f"{name} {float(metrics[key]):.4g}")
    return {group: ", ".join(values) for group, values in groups.items()}


def _shown(path: str | Path) -> Path:
    """``path`` relative to the working directory when it lies under it (as the README names a run's files)."""
    path = Path(path).resolve()
    return path.relative_to(Path.cwd().resolve()) if path.is_relative_to(Path.cwd().resolve()) else path


def _mean(values: dict[int, float], steps: list[int]) -> float:
    return sum(values[step] for step in steps) / len(steps)


def _span(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
