"""`RLProgressBar`: RL steps against ``max_steps`` with the numbers an RL run is watched by.

On a terminal it is Lightning's tqdm bar, counting optimizer steps (``step 12/60``) instead of ``Epoch 0/-2``
batches, with outcome reward, accuracy, the flow rewards' nonzero fraction and tokens/s in place of ``v_num``.
When stdout is not a terminal (a redirected log, a batch job) there is no bar: one line is printed every
``line_every_n_steps`` steps, e.g. ``step 20/60 | reward 0.562 | acc 0.562 | flow_nz 0.31 | tok/s 1.2e+03 | 41 s``.
The flowkit CLI adds it to every run whose trainer has ``enable_progress_bar`` on. :class:`LoopProgress` does the
same for a loop that runs outside Lightning's (offline flow pretraining).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from tqdm.auto import tqdm

# label → logged metric; a metric a module does not log is left out of the bar.
DEFAULT_METRICS = {
    "reward": "train/outcome_reward",
    "acc": "train/accuracy",
    "flow_nz": "flow/reward_nonzero_frac",
    "tok/s": "train/tokens_per_s",
}


class RLProgressBar(TQDMProgressBar):
    """Steps against ``max_steps`` and the RL metrics on a terminal; one summary line per N steps in a log.

    Args:
        metrics: ``{label: logged metric name}`` shown after the step count (default: reward, accuracy, flow
            nonzero fraction, tokens/s). With none of them logged, the module's own ``prog_bar`` metrics are shown.
        line_every_n_steps: when stdout is not a terminal, print one summary line every this many steps
            (and after the last one).
        refresh_rate: tqdm refresh rate on a terminal, in steps.
    """

    def __init__(self, metrics: dict[str, str] | None = None, line_every_n_steps: int = 10, refresh_rate: int = 1):
        super().__init__(refresh_rate=refresh_rate)
        if line_every_n_steps < 1:
            raise ValueError(f"RLProgressBar.line_every_n_steps must be >= 1, got {line_every_n_steps}")
        self.metrics = dict(DEFAULT_METRICS if metrics is None else metrics)
        self.line_every_n_steps = line_every_n_steps
        self.interactive = True
        self._start = 0.0
        self._last_line_step = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.interactive = sys.stdout.isatty()
        if not self.interactive:
            self.disable()  # tqdm's carriage returns would fill a log file; summary lines replace the bars

    # ---------------------------------------------------------------------------------------------- what it shows
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        logged = trainer.callback_metrics
        shown = {label: float(logged[key]) for label, key in self.metrics.items() if key in logged}
        if not shown:
            shown = {k: v for k, v in super().get_metrics(trainer, pl_module).items() if k != "v_num"}
        return {label: _format(value) for label, value in shown.items()}

    def summary_line(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str:
        parts = [f"step {trainer.global_step}/{_total(trainer) or '?'}"]
        parts += [f"{label} {value}" for label, value in self.get_metrics(trainer, pl_module).items()]
        parts.append(f"{time.monotonic() - self._start:.0f} s")
        return " | ".join(parts)

    # ---------------------------------------------------------------------------------------------- training hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start = time.monotonic()

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        if _total(trainer) is None:  # an epoch-based run: Lightning's epoch bar
            return
        # The RL prompt stream is endless: count optimizer steps against max_steps, not batches of an epoch.
        self.train_progress_bar.reset(total=_total(trainer))
        self.train_progress_bar.n = trainer.global_step  # a resumed run starts where it stopped
        self.train_progress_bar.set_description("step")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self.interactive:
            # tqdm clears a bar below the main one and moves up without a carriage return: the next line printed
            # (Lightning's "`Trainer.fit` stopped") would start at that bar's last column.
            sys.stdout.write("\r")
            sys.stdout.flush()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.interactive and _total(trainer) is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        elif self.interactive:
            if self._should_update(step, self.train_progress_bar.total):
                self.train_progress_bar.n = step
                self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
            if step >= self.train_progress_bar.total:
                # Closed at the last step, not at train end: Lightning's "stopped" line and the export lines come
                # between the two and were printed onto the open bar's line, and the close then drew it again.
                self.train_progress_bar.close()
            return
        last = _total(trainer) is not None and step >= _total(trainer)
        if trainer.is_global_zero and step != self._last_line_step and (step % self.line_every_n_steps == 0 or last):
            self._last_line_step = step
            print(self.summary_line(trainer, pl_module), flush=True)


class LoopProgress:
    """Steps of a loop outside Lightning's: a tqdm bar on a terminal; when stdout is not one, a line every
    ``total / lines`` steps and after the last (``flow pretraining 120/600 | loss 0.0712 | 6 s``).

    Args:
        desc: what the loop does; total: its steps; initial: steps already done (a resumed loop).
        enabled: False shows nothing (ranks other than 0).
        lines: summary lines per loop in a log.
    """

    def __init__(self, desc: str, total: int, initial: int = 0, enabled: bool = True, lines: int = 10):
        self.desc, self.total, self.enabled = desc, total, enabled
        self.every = max(1, total // lines)
        self._start = time.monotonic()
        self.bar = tqdm(desc=desc, total=total, initial=initial) if enabled and sys.stdout.isatty() else None

    def update(self, done: int, **postfix: float) -> None:
        """``done`` steps are finished; ``postfix`` are the numbers to show (e.g. ``loss=0.07``)."""
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix({k: f"{v:.4f}" for k, v in postfix.items()}, refresh=False)
        elif self.enabled and (done % self.every == 0 or done == self.total):
            numbers = "".join(f" | {k} {v:.4f}" for k, v in postfix.items())
            print(f"{self.desc} {done}/{self.total}{numbers} | {time.monotonic() - self._start:.0f} s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _total(trainer: L.Trainer) -> int | None:
    return trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None


def _format(value: Any) -> str:
    if isinstance(value, str):
        return value
    value = float(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2e}" if 0 < abs(value) < 0.01 else f"{value:.3f}"
