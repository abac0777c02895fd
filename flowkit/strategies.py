"""DeepSpeed strategies: ZeRO-offload-aware on GPUs, and a CPU variant (gloo) that CI runs.

Lightning's ``DeepSpeedStrategy`` takes the module's single optimizer — flowkit's policy and flow share
one optimizer with two parameter groups, so nothing special is needed for that. Three gaps
are filled here:

* ZeRO optimizer offload refuses a plain ``torch.optim.Adam(W)``; :class:`FlowkitDeepSpeedStrategy`
  rebuilds it as ``DeepSpeedCPUAdam`` with the same parameter groups and hyperparameters, so modules
  stay strategy-agnostic.
* A module with several backward passes per optimizer step (:func:`accumulate_until_step`,
  :func:`manual_backward`, :func:`average_gradients`) needs DeepSpeed's accumulation boundary moved to ``step()``,
  and under DDP its gradients averaged once per step instead of in every backward.
* Lightning refuses DeepSpeed without CUDA; on the CPU accelerator :class:`FlowkitDeepSpeedStrategy` runs ZeRO
  0–3 on CPU processes (``devices=N``) over gloo with DeepSpeed's CPU accelerator, so a GPU config rehearses on
  CPU by setting ``trainer.accelerator: cpu`` alone. :class:`CPUDeepSpeedStrategy` is the same strategy refusing
  any other accelerator (the ``deepspeed_cpu_*`` names).

Use them in a config as::

    trainer:
      strategy:
        class_path: flowkit.strategies.CPUDeepSpeedStrategy
        init_args: {config: configs/deepspeed/zero2.json}

or by the registered names ``deepspeed_cpu_stage_2``, ``deepspeed_cpu_stage_3``,
``deepspeed_cpu_stage_3_offload`` and ``deepspeed_stage_3_offload_cpuadam`` (GPU), once this module is
imported (the ``flowkit`` CLI imports it).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    StrategyRegistry,
)
from torch.optim import Optimizer

from flowkit.checkpointing.safe_loading import tensors_only_loading
from flowkit.step.optimizer import average_over_ranks

log = logging.getLogger(__name__)


class FlowkitDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy; with ZeRO optimizer offload, Adam/AdamW become ``DeepSpeedCPUAdam``; on the
    CPU accelerator, ZeRO on CPU processes over gloo (fp32 or bf16)."""

    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, CPUAccelerator):
            super().setup_environment()
            return
        _use_deepspeed_cpu_accelerator()
        # Lightning checks, and DeepSpeed reads, the device index as the local rank; CPU devices carry
        # none by default (a CPU tensor ignores the index).
        self.parallel_devices = [torch.device("cpu", index) for index in range(len(self.parallel_devices))]
        # Skip DeepSpeedStrategy.setup_environment: its only addition is the CUDA check.
        DDPStrategy.setup_environment(self)

    def _get_process_group_backend(self) -> str:
        if isinstance(self.accelerator, CPUAccelerator):
            # DeepSpeed's CPU accelerator would pick oneCCL, which is rarely installed.
            return self._process_group_backend or "gloo"
        return super()._get_process_group_backend()

    def _init_optimizers(self) -> tuple[Optimizer, Any]:
        optimizer, scheduler_config = super()._init_optimizers()
        if not self._offloads_optimizer():
            return optimizer, scheduler_config
        offloaded = _as_cpu_adam(optimizer)
        if scheduler_config is not None:
            # The scheduler keeps a reference to the optimizer whose param_groups it steps.
            scheduler_config.scheduler.optimizer = offloaded
        return offloaded, scheduler_config

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        # DeepSpeed's engine unpickles its files with weights_only=False; this loads tensors and plain data only.
        with tensors_only_loading(checkpoint_path):
            saved_ranks = zero_checkpoint_ranks(checkpoint_path)
            if saved_ranks is not None and saved_ranks != self.world_size:
                return self._load_universal(Path(checkpoint_path), saved_ranks, weights_only)
            return super().load_checkpoint(checkpoint_path, weights_only)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.is_global_zero:
            _remove_other_ranks_partitions(Path(filepath), self.world_size)

    def _load_universal(self, checkpoint_path: Path, saved_ranks: int, weights_only: bool | None) -> dict[str, Any]:
        """A ZeRO checkpoint of ``saved_ranks`` ranks at this run's other number: DeepSpeed's universal checkpoint
        (``ds_to_universal``: every parameter's fp32 weights and Adam moments whole), written beside it by rank 0,
        loaded by every rank into its own partitions, then removed."""
        universal = checkpoint_path.with_name(f".{checkpoint_path.name}.universal")
        if self.is_global_zero:
            log.warning("resuming a checkpoint of %d ranks on %d: converting %s to DeepSpeed's universal checkpoint",
                        saved_ranks, self.world_size, checkpoint_path)
            write_universal_checkpoint(checkpoint_path, universal)
        self.barrier("universal checkpoint written")
        config = self.deepspeed_engine._config
        config.load_universal_checkpoint = True
        try:
            return DeepSpeedStrategy.load_checkpoint(self, str(universal), weights_only)
        finally:
            config.load_universal_checkpoint = False
            self.barrier("universal checkpoint read")
            if self.is_global_zero:
                shutil.rmtree(universal, ignore_errors=True)

    def _auto_select_batch_size(self) -> int:
        # Only DeepSpeed's throughput logging reads it. Lightning takes it from the loader's batch
        # sampler, which a loader of whole batches (flowkit's prompt stream: batch_size=None) lacks.
        loader = self.lightning_module.trainer.fit_loop._data_source
        if loader.is_defined() and getattr(loader.dataloader(), "batch_sampler", None) is None:
            return 1
        return super()._auto_select_batch_size()

    def _offloads_optimizer(self) -> bool:
        offload = (self.config or {}).get("zero_optimization", {}).get("offload_optimizer") or {}
        return offload.get("device", "none") in ("cpu", "nvme")


class CPUDeepSpeedStrategy(FlowkitDeepSpeedStrategy):
    """:class:`FlowkitDeepSpeedStrategy` on CPU processes only (gloo, ``DS_ACCELERATOR=cpu``, fp32 or bf16)."""

    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, CPUAccelerator):
            raise TypeError(
                f"{type(self).__name__} runs on the CPU accelerator, got {type(self.accelerator).__name__};"
                " on GPUs use flowkit.strategies.FlowkitDeepSpeedStrategy"
            )
        super().setup_environment()


def zero_checkpoint_ranks(checkpoint: str | os.PathLike) -> int | None:
    """How many ranks saved a Lightning DeepSpeed checkpoint directory (its ZeRO optimizer partitions); None when
    ``checkpoint`` is none."""
    latest = Path(checkpoint) / "latest"
    if not latest.is_file():
        return None
    tag = Path(checkpoint) / latest.read_text().strip()
    states = next(iter(sorted(tag.glob("*model_states.pt"))), None)
    if states is None:
        return None
    # The engine's record, not the partition files: a save by fewer ranks leaves the extra ranks' old files behind.
    return int(torch.load(states, map_location="cpu", weights_only=True, mmap=True)["dp_world_size"])


def _remove_other_ranks_partitions(checkpoint: Path, world_size: int) -> None:
    """Delete the partitions of ranks ``>= world_size`` that an earlier save by more ranks left in ``checkpoint``'s
    tag: DeepSpeed overwrites only its own ranks' files, and its consolidation (``zero_to_fp32``, ``flowkit export``)
    takes every partition file it finds."""
    latest = checkpoint / "latest"
    if not latest.is_file():
        return
    for partition in (checkpoint / latest.read_text().strip()).glob("*zero_pp_rank_*_states.pt"):
        rank = re.search(r"zero_pp_rank_(\d+)_", partition.name)
        if rank is not None and int(rank.group(1)) >= world_size:
            partition.unlink()


def write_universal_checkpoint(checkpoint: Path, universal: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of the Lightning DeepSpeed checkpoint directory ``checkpoint`` into
    ``universal`` (replaced), in the layout the engine's ``load_universal`` reads: ``latest_universal`` naming the tag.

    The converter takes only tensors in the module state, so it reads a copy without the others (e.g. the flow's
    rollout buffer, ``_extra_state``); the universal tag then gets the original module state, which the engine loads
    whole, with Lightning's client state in it."""
    from deepspeed.checkpoint import ds_to_universal

    tag = (checkpoint / "latest").read_text().strip()
    ranks = zero_checkpoint_ranks(checkpoint)
    shutil.rmtree(universal, ignore_errors=True)
    tensors_only = universal / "input"
    tensors_only.mkdir(parents=True)
    saved_by = re.compile(rf"zero_pp_rank_({'|'.join(map(str, range(ranks)))})_mp_rank_")
    for partition in (checkpoint / tag).glob("*_states.pt"):
        if "optim_states" in partition.name and saved_by.search(partition.name):
            os.symlink(partition.resolve(), tensors_only / partition.name)
    model_states = [path for path in sorted((checkpoint / tag).glob("*model_states.pt"))
                    if not path.name.startswith("zero_pp_rank_") or saved_by.search(path.name)]
    for states in model_states:
        state = torch.load(states, map_location="cpu", weights_only=True)
        state["module"] = {k: v for k, v in (state.get("module") or {}).items() if isinstance(v, torch.Tensor)}
        torch.save(state, tensors_only / states.name)
    arguments = ["--input_folder", str(tensors_only), "--output_folder", str(universal / tag), "--inject_missing_state",
                 "--num_extract_workers", "1", "--num_merge_workers", "1"]
    argv, sys.argv = sys.argv, ["ds_to_universal", *arguments]  # it parses sys.argv only
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress
            ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = argv
    for states in model_states:
        shutil.copyfile(states, universal / tag / states.name)
    shutil.rmtree(tensors_only)
    (universal / "latest_universal").write_text(tag)


def _zero_stage_3(strategy: Any) -> bool:
    return isinstance(strategy, DeepSpeedStrategy) and bool(strategy.config) and strategy.zero_stage_3


def full_parameters(trainer: L.Trainer, module: torch.nn.Module) -> contextlib.AbstractContextManager:
    """A context in which ``module``'s parameters are whole: under ZeRO-3 each rank holds only shards.

    Under ZeRO-3 this gathers every parameter on every rank (read-only) — a collective, so all ranks must
    enter it; elsewhere it does nothing.
    """
    strategy = trainer.strategy
    if _zero_stage_3(strategy):
        import deepspeed

        # A forward through the engine that ran no sub-module (a validation_step whose rollouts come from vLLM)
        # leaves ZeRO-3's prefetch of the next sub-modules in flight; GatheredParameters skips parameters in
        # flight and then refuses to re-partition them. Waiting for and releasing every fetch first avoids that.
        strategy.model.empty_partition_cache()
        return deepspeed.zero.GatheredParameters(list(module.parameters()))
    return contextlib.nullcontext()


@contextlib.contextmanager
def whole_weights_for_generation(trainer: L.Trainer | None, module: torch.nn.Module):
    """A context in which ``module`` generates with whole weights and without collectives, as TRL's
    ``unwrap_model_for_generation`` under ZeRO-3: every parameter gathered once, and ZeRO-3's per-module fetch and
    release hooks off meanwhile. Otherwise ZeRO-3 all-gathers each layer's weights in every decoding step's forward,
    and ranks must keep stepping in lockstep until the slowest is done (``synced_gpus``) — on 2 CPU ranks one
    generation of 28 tokens took minutes that way. Costs the whole model on each rank while generating (TRL's default
    ``ds3_gather_for_generation``). Elsewhere (no ZeRO-3, no trainer) nothing; a collective under ZeRO-3 (every rank
    enters)."""
    if trainer is None or not _zero_stage_3(trainer.strategy):
        yield
        return
    engine = trainer.strategy.model
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)  # training: the ZeRO-3 optimizer's
    with full_parameters(trainer, module):
        for param in module.parameters():
            param.ds_active_sub_modules.clear()
        hooks = offload.forward_hooks + offload.backward_hooks
        for hook in hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)  # the hooks back (the trace re-records)


def accumulate_until_step(trainer: L.Trainer, max_grad_norm: float | None) -> None:
    """Set up DeepSpeed for a module that runs several backward passes (micro-batches, loss pieces) and then one
    optimizer step, with manual optimization; call from the module's ``setup("fit")`` (before the engine is built).

    DeepSpeed's default ("managed") accumulation treats every backward as a boundary when
    gradient_accumulation_steps is 1, so ZeRO-2 kept only the last backward's gradients;
    ``managed_gradient_accumulation: false`` makes ``step()`` the boundary (tested with DeepSpeed 0.19.8; a DeepSpeed
    without the option is refused, since it would silently drop gradients). Lightning's ``clip_gradients`` does
    nothing under DeepSpeed, so ``max_grad_norm`` becomes the config's ``gradient_clipping`` (a different value there
    is a conflict). Elsewhere this does nothing.
    """
    strategy = trainer.strategy
    if not isinstance(strategy, DeepSpeedStrategy):
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not hasattr(DeepSpeedEngine, "managed_gradient_accumulation"):
        raise ValueError("several backward passes per optimizer step under DeepSpeed need a DeepSpeed with "
                         "managed_gradient_accumulation (0.19.8 has it): upgrade deepspeed")
    if strategy.config.get("managed_gradient_accumulation", False):
        raise ValueError("the DeepSpeed config's managed_gradient_accumulation must be false (flowkit runs several "
                         "backward passes per optimizer step)")
    strategy.config["managed_gradient_accumulation"] = False
    if max_grad_norm is not None:
        configured = strategy.config.get("gradient_clipping") or None
        if configured is not None and configured != max_grad_norm:
            raise ValueError(f"max_grad_norm {max_grad_norm} conflicts with the DeepSpeed config's gradient_clipping "
                             f"{configured}")
        strategy.config["gradient_clipping"] = max_grad_norm


def manual_backward(module: L.LightningModule, loss: torch.Tensor) -> None:
    """``module.manual_backward(loss)`` for one of a step's several backward passes.

    DeepSpeed: all of them run inside one engine forward (Lightning calls ``training_step`` through it), and ZeRO
    resets its per-backward gradient-hook state (which parameters to expect, copy-or-accumulate) only at an engine
    forward; so it is reset here, as that forward would, or ZeRO-2/3 overwrite or miss gradients of earlier backward
    passes. DDP: its reducer expects one backward per forward reaching every parameter, which a step of micro-batches
    and flow pieces is not; so gradients are not synchronized in the backward here, but averaged over the ranks once
    before the optimizer step (:func:`average_gradients`)."""
    strategy = module.trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        reset = getattr(getattr(strategy.model, "optimizer", None), "clear_backward_seen_flag", None)
        if reset is not None:
            reset()
    elif isinstance(strategy, DDPStrategy) and strategy.model is not None:
        strategy.model.require_backward_grad_sync = False  # what DDP.no_sync() sets, for the whole step
    module.manual_backward(loss)


def average_gradients(module: L.LightningModule) -> None:
    """Under DDP (where :func:`manual_backward` leaves gradients unsynchronized), replace every gradient by its mean
    over the ranks (:func:`~flowkit.step.optimizer.average_over_ranks`), before clipping and the optimizer step;
    elsewhere nothing (DeepSpeed reduces in its backward)."""
    strategy = module.trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, DDPStrategy) or strategy.world_size < 2:
        return
    average_over_ranks([p for p in module.parameters() if p.requires_grad])


def _use_deepspeed_cpu_accelerator() -> None:
    """Point DeepSpeed at its CPU accelerator, also for ranks this process launches."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


def _as_cpu_adam(optimizer: Optimizer) -> Optimizer:
    """``DeepSpeedCPUAdam`` over ``optimizer``'s parameter groups (lr, betas, eps, weight decay kept)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if isinstance(optimizer, DeepSpeedCPUAdam):
        return optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise TypeError(
            f"ZeRO optimizer offload needs DeepSpeedCPUAdam; flowkit converts Adam/AdamW, got {type(optimizer).__name__}"
        )
    groups = [dict(group) for group in optimizer.param_groups]
    defaults = optimizer.defaults
    return DeepSpeedCPUAdam(
        groups,
        lr=defaults["lr"],
        betas=defaults["betas"],
        eps=defaults["eps"],
        weight_decay=defaults["weight_decay"],
        adamw_mode=isinstance(optimizer, torch.optim.AdamW),
    )


def _register() -> None:
    cpu = CPUDeepSpeedStrategy
    entries = {
        "deepspeed_cpu_stage_2": (cpu, "DeepSpeed ZeRO stage 2 on CPU processes (gloo)", {"stage": 2}),
        "deepspeed_cpu_stage_3": (cpu, "DeepSpeed ZeRO stage 3 on CPU processes (gloo)", {"stage": 3}),
        "deepspeed_cpu_stage_3_offload": (
            cpu,
            "DeepSpeed ZeRO stage 3 with optimizer offload (DeepSpeedCPUAdam) on CPU processes",
            {"stage": 3, "offload_optimizer": True},
        ),
        "deepspeed_stage_3_offload_cpuadam": (
            FlowkitDeepSpeedStrategy,
            "DeepSpeed ZeRO stage 3 with optimizer offload; Adam/AdamW become DeepSpeedCPUAdam",
            {"stage": 3, "offload_optimizer": True},
        ),
    }
    for name, (cls, description, init_params) in entries.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description, **init_params)


_register()
