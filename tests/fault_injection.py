"""Test helper callbacks that break training on purpose, for subprocess runs of the ``flowkit`` CLI
(``--trainer.callbacks+=fault_injection.NAME``, with ``tests/`` on PYTHONPATH).

* :class:`LearningRateJump`: from RL step ``step`` on, every parameter group's lr is ``lr`` (``.nan``: the next
  optimizer step makes the weights NaN, as a schedule that divides by zero would).
* :class:`NanLoss`: in the first batch at RL step ``step``, on rank ``rank`` only, the ``loss`` ("policy" or "flow")
  is NaN (once: a skipped step does not advance the step count).
* :class:`SignalMidPush`: send this process ``signal`` (``SIGKILL``; ``SIGSTOP``: a trainer that hangs or whose host
  vanished, its sockets left open) in its weight push of policy version ``version`` to a rollout server
  (``rollout.engine: server``), right after the push's first bucket went out.
"""

from __future__ import annotations

import os
import signal

import lightning as L


class LearningRateJump(L.Callback):
    def __init__(self, step: int, lr: float):
        self.step, self.lr = step, lr

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.step:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = self.lr


class NanLoss(L.Callback):
    def __init__(self, step: int, rank: int = 0, loss: str = "policy"):
        self.step, self.rank, self.loss = step, rank, loss
        self._restore = None
        self._done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._done or trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        self._done = True
        if self.loss == "policy":
            actor = pl_module.actor
            real = actor.loss
            actor.loss = lambda *args: real(*args) * float("nan")
            self._restore = lambda: setattr(actor, "loss", real)
        else:
            reward = pl_module.reward_model
            real = reward.begin_step

            def poisoned(step, batch):  # the step's online loss pieces return NaN
                scorer = real(step, batch)
                end_step = scorer.end_step
                scorer.end_step = lambda batch: [lambda piece=piece: piece() * float("nan")
                                                 for piece in end_step(batch)]
                return scorer
            reward.begin_step = poisoned
            self._restore = lambda: setattr(reward, "begin_step", real)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._restore is not None:
            self._restore()
            self._restore = None


class SignalMidPush(L.Callback):
    def __init__(self, version: int, signal: str = "SIGKILL"):
        self.version, self.signal = version, signal

    def on_fit_start(self, trainer, pl_module):
        from flowkit.llm.server_engine import WeightChannel

        send_bucket = WeightChannel.send_bucket

        def killing(channel, bucket, version, last):
            payload_bytes = send_bucket(channel, bucket, version, last)
            if version == self.version:  # the server is now inside the push, waiting for the next bucket
                os.kill(os.getpid(), getattr(signal, self.signal))
            return payload_bytes

        WeightChannel.send_bucket = killing
