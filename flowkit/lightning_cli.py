"""The Lightning side of the ``flowkit`` command line: :class:`FlowkitCLI` (a LightningCLI) and the run directory.

:mod:`flowkit.cli` imports this module only when a command runs (Lightning takes seconds to import), so that
``flowkit --help`` and a plugin's failure to load never wait for it.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import sys
import warnings
from argparse import ArgumentError
from collections.abc import Callable
from pathlib import Path

import yaml
from jsonargparse import Namespace, set_parsing_settings
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_module, rank_zero_only

from flowkit.checkpointing import fault_tolerance_defaults
from flowkit.checkpointing.preemption import VALIDATION_INTERRUPTED_KEY
from flowkit.checkpointing.resume import (
    EXPORTED_KEY, HPC_CHECKPOINT_GLOB, checkpoint_metadata, newest_checkpoint, requeued_slurm_job,
)
from flowkit.checkpointing.run_lock import RunDirectoryLock, lock_run_directory
from flowkit.checkpointing.safe_loading import tensors_only_loading
from flowkit.command_help import LIGHTNING_COMMANDS, command_description, first_paragraph
from flowkit.errors import ConfigError, did_you_mean
from flowkit.modules.callbacks import ExportArtifacts
from flowkit.modules.completions import CompletionLogs
from flowkit.modules.summary import ParameterSummary, RunSummary
from flowkit.parser_errors import config_file_with_key
from flowkit.registry import SUBCOMMANDS

__all__ = ["FlowkitCLI", "FlowkitTrainer", "RunCSVLogger", "place_run"]

log = logging.getLogger(__name__)

# An option group's help is the string literal under each field (flowkit.options): `--model.help` prints it.
set_parsing_settings(docstring_parse_attribute_docstrings=True)


def _trainer_method(fn: Callable) -> Callable:
    """``fn(trainer, model, datamodule, **options)`` as a method of the Trainer, which is how LightningCLI runs
    a subcommand; jsonargparse reads the options from the method's signature."""

    def method(self, model: LightningModule, datamodule: LightningDataModule | None = None, **options):
        return fn(self, model, datamodule, **options)

    params = list(inspect.signature(fn).parameters.values())
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = inspect.Signature([self_param, *params[1:]])
    method.__doc__ = fn.__doc__
    method.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k != "trainer"}
    return method


class FlowkitTrainer(Trainer):
    """Lightning's Trainer; :class:`FlowkitCLI` attaches the registered subcommands to it as methods.

    ``requested_ckpt_path`` is the checkpoint ``fit`` resumes, known from the start of the fit
    (:func:`~flowkit.checkpointing.resume.resume_checkpoint`; Lightning's ``ckpt_path`` is set only when it restores
    it).
    """

    requested_ckpt_path: str | None = None

    def fit(self, *args, ckpt_path=None, **kwargs):
        # The CLI passes a resolved path; Lightning's keywords ("last", "hpc", ...) may resolve to no checkpoint.
        self.requested_ckpt_path = None if ckpt_path in (None, "last", "hpc", "best", "registry") else str(ckpt_path)
        return super().fit(*args, ckpt_path=ckpt_path, **kwargs)


class FlowkitCLI(LightningCLI):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("trainer_class", FlowkitTrainer)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("trainer_defaults", fault_tolerance_defaults())
        for name, fn in SUBCOMMANDS.items():
            setattr(FlowkitTrainer, name, _trainer_method(fn))
        # Lightning's --optimizer / --lr_scheduler would replace the module's own configure_optimizers, which
        # flowkit's modules need (PolicyModule: one AdamW over the policy, value-head and reward-model groups).
        kwargs.setdefault("auto_configure_optimizers", False)
        parser_kwargs = dict(kwargs.get("parser_kwargs") or {})
        for command in ("fit", "validate", "test", "predict", *SUBCOMMANDS):
            summary = LIGHTNING_COMMANDS.get(command) or first_paragraph(SUBCOMMANDS[command].__doc__)
            parser_kwargs.setdefault(command, {}).setdefault("description", command_description(command, summary))
        kwargs["parser_kwargs"] = parser_kwargs
        self._run_lock: RunDirectoryLock | None = None
        try:
            super().__init__(*args, **kwargs)
        finally:
            if self._run_lock is not None:
                self._run_lock.release()

    def _parse_ckpt_path(self) -> None:
        """Keep the configuration the YAML files and the command line gave: a checkpoint supplies state only.

        LightningCLI would merge ``--ckpt_path``'s saved ``hyper_parameters`` over the parsed model config,
        which lets a checkpoint file override options the user typed (``--model.init_args.validation.temperature 0``)
        and decide what code runs (``trust_remote_code: true`` with a ``backbone`` carrying custom code).
        """

    def init_parser(self, **kwargs):
        # No abbreviations: `--trainer.max_step 3` is an unknown key (as in YAML), not a silent `max_steps`.
        kwargs.setdefault("allow_abbrev", False)
        return super().init_parser(**kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        commands = dict(LightningCLI.subcommands())
        for name in SUBCOMMANDS:
            commands[name] = {"model", "datamodule"}
        return commands

    def parse_arguments(self, parser, args) -> None:
        # With `args` given (`flowkit.cli.main([...])`, tests), sys.argv belongs to the caller (e.g. pytest).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within")
            try:
                super().parse_arguments(parser, args)
            except ArgumentError as err:
                message = self._unknown_key_message(str(err), sys.argv[1:] if args is None else list(args))
                if message is None:
                    raise
                raise ConfigError(message) from err

    def _unknown_key_message(self, report: str, argv: list[str]) -> str | None:
        """An option of the command line or a key of a ``--config`` file the parser does not know, with the nearest
        known one; a config file's key is reported with the file's name."""
        given = re.match(r"unrecognized arguments: --?([^\s=]+)", report)
        in_config = re.fullmatch(r"Subcommand '(.+)' does not accept option '(.+)'", report)
        if not (given or in_config):
            return None
        command = in_config.group(1) if in_config else next((a for a in argv if not a.startswith("-")), "")
        known = [option[2:] for action in getattr(self, "_subcommand_parsers", {}).get(command, self.parser)._actions
                 for option in action.option_strings if option.startswith("--")]
        key = (in_config or given).group(2 if in_config else 1)
        suggestion = did_you_mean(key, known)
        source = config_file_with_key(argv, key) if in_config else None
        if source is not None:
            return f"{source}: unknown key {key!r}{suggestion}"
        return f"unknown option --{key}{suggestion}"

    def before_instantiate_classes(self) -> None:
        self._config_as_given = self.config.clone()
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand == "fit":  # one run at a time in a run directory, until this command ends
            self._run_lock = lock_run_directory(config.trainer.default_root_dir or os.getcwd())
        self._checkpoint_dirs = place_run(config, fresh_fit=self.subcommand == "fit" and config.get("ckpt_path") is None
                                          and not self._requeued(config))

    def _requeued(self, config) -> bool:
        """A requeued SLURM job (the same command again) resumes its run from the newest checkpoint, as Lightning's
        SLURM requeue expects, instead of being refused as a second run."""
        if self.subcommand != "fit" or config.get("ckpt_path") is not None or not requeued_slurm_job():
            return False
        config.ckpt_path = "last"
        return True

    def before_fit(self) -> None:
        """The resume's checks (:meth:`_check_resume`), then the note on a validation the fit will not reach (not
        for a resume that has nothing left to do)."""
        self._check_resume()
        _note_unreached_validation(self.config[self.subcommand])

    def _check_resume(self) -> None:
        """Before any work of a resume: ``last`` is the newest of ``last*.ckpt`` and ``hpc_ckpt_N.ckpt``; a file that
        is no Lightning checkpoint, or one the model's config does not fit (``check_resume``), is one line; a run
        with nothing left to do (``max_steps`` reached, its validation and export done) says so, with what its fit
        did at its end, and ends, writing nothing."""
        config = self.config_init[self.subcommand]
        path = config.get("ckpt_path")
        run_dir = Path(self.trainer.default_root_dir)
        if path == "last":
            path = newest_checkpoint(run_dir, self._checkpoint_dirs)
            if path is None:
                log.warning("--ckpt_path last: %s holds no checkpoint yet; starting the run", run_dir)
            else:
                log.warning("resuming from the newest checkpoint, %s", path)
            config.ckpt_path = None if path is None else str(path)
        if path is None or path in ("hpc", "best", "registry"):
            return
        checkpoint = checkpoint_metadata(Path(path))
        if checkpoint is None:  # unreadable: the resume falls back to the checkpoint kept before it
            return
        check = getattr(self.model, "check_resume", None)
        if callable(check):
            check(checkpoint, str(path))
        if self._nothing_left(checkpoint, Path(path)):
            step = int(checkpoint.get("global_step", 0))
            exports = any(isinstance(callback, ExportArtifacts) for callback in self.trainer.callbacks)
            done = [*_validation_done(run_dir, step), *(["exported"] if exports else [])]
            ended = f" ({'; '.join(done)})" if done else ""
            print(f"nothing left to do: {path} is at step {step} of --trainer.max_steps {self.trainer.max_steps}, "
                  f"and its fit ended{ended}; raise --trainer.max_steps to train further", flush=True)
            sys.exit(0)

    def _nothing_left(self, checkpoint: dict, path: Path) -> bool:
        """The checkpoint met ``max_steps`` and the run (if it exports) wrote its export: before the checkpoint was
        saved (recorded in it) or after. A checkpoint saved in a validation that SIGTERM stopped is done only once an
        export followed it: the fit that resumed it ran that validation again first, then exported."""
        max_steps = self.trainer.max_steps
        if max_steps < 0 or int(checkpoint.get("global_step", -1)) < max_steps:
            return False
        states = checkpoint.get("callbacks") or {}
        interrupted = any(isinstance(state, dict) and state.get(VALIDATION_INTERRUPTED_KEY)
                          for state in states.values())
        if not any(isinstance(c, ExportArtifacts) for c in self.trainer.callbacks):
            return not interrupted
        if checkpoint.get(EXPORTED_KEY):
            return True
        # The final checkpoint is usually saved at the end of the last step, before the export: then an export
        # written after it is this checkpoint's.
        saved_at = (path / "latest" if path.is_dir() else path).stat().st_mtime_ns
        run_dir = Path(self.trainer.default_root_dir)
        return any(export.stat().st_mtime_ns >= saved_at for callback in self.trainer.callbacks
                   if isinstance(callback, ExportArtifacts) for export in run_dir.glob(f"version_*/{callback.subdir}"))

    def instantiate_trainer(self, **kwargs):
        self._load_data_early()
        # The run's saved config.yaml is the configuration as given, without the paths place_run filled in, so
        # `fit --config runs/a/version_0/config.yaml --trainer.default_root_dir runs/b` starts a run of its own.
        placed, self.config = self.config, self._config_as_given
        try:
            return super().instantiate_trainer(**kwargs)
        finally:
            self.config = placed


    def _load_data_early(self) -> None:
        """Load and check the data of fit / validate / test now, before the Trainer prints its start-up lines and
        sets up the run: a bad record or a prompt too long for the model is one line, before any work."""
        stage = {"fit": "fit", "validate": "validate", "test": "test"}.get(self.subcommand)
        use_module = getattr(self.datamodule, "use_module", None)
        if stage is not None and use_module is not None:
            use_module(self.model)
            self.datamodule.setup(stage)


def place_run(config, fresh_fit: bool) -> list[Path]:
    """One run, one directory: ``trainer.default_root_dir`` (the run directory) holds everything of the run.

    Unless the config names its own progress bar, :class:`~flowkit.modules.progress.RLProgressBar` shows the run;
    unless it names its own, :class:`~flowkit.modules.summary.ParameterSummary` is the model summary and
    :class:`~flowkit.modules.summary.RunSummary` prints the run's result at the end of ``fit``; unless it names its
    own, :class:`~flowkit.modules.completions.CompletionLogs` writes a few completions every 10 RL steps.
    Unless the config names its own logger, the run logs to ``<run dir>/version_N`` (a :class:`RunCSVLogger`: ``metrics.csv``, steps from 1,
    the resolved ``config.yaml``, ``export/``); every ModelCheckpoint without a ``dirpath`` writes to
    ``<run dir>/checkpoints``, shared by the run's versions so ``--ckpt_path last`` resumes this run and no other.
    A fresh ``fit`` (no ``--ckpt_path``) into a run directory that already holds checkpoints is refused: two
    runs never share a checkpoint. Returns the checkpoint directories.
    """
    trainer = config.trainer
    run_dir = Path(trainer.default_root_dir or os.getcwd())
    if trainer.get("logger") in (None, True):
        trainer.logger = Namespace(class_path="flowkit.lightning_cli.RunCSVLogger",
                                   init_args=Namespace(save_dir=str(run_dir), name=""))
    callbacks = trainer.get("callbacks") or []
    if trainer.get("enable_progress_bar") is not False and not any(
            isinstance(c, Namespace) and _is_subclass(c.get("class_path"), ProgressBar) for c in callbacks):
        trainer.callbacks = [*callbacks, Namespace(class_path="flowkit.modules.progress.RLProgressBar",
                                                   init_args=Namespace())]
    if trainer.get("enable_model_summary") is not False:
        _add_callback_unless_present(trainer, ModelSummary, ParameterSummary)
    _add_callback_unless_present(trainer, RunSummary, RunSummary)
    _add_callback_unless_present(trainer, CompletionLogs, CompletionLogs)
    checkpoint_dirs = []
    for callback in trainer.get("callbacks") or []:
        if not isinstance(callback, Namespace) or not _is_subclass(callback.get("class_path"), ModelCheckpoint):
            continue
        if callback.init_args.get("dirpath") is None:
            callback.init_args.dirpath = str(run_dir / "checkpoints")
        checkpoint_dirs.append(Path(callback.init_args.dirpath))
    checkpoint_dirs = checkpoint_dirs or [run_dir / "checkpoints"]
    if not fresh_fit:
        return checkpoint_dirs
    for directory in checkpoint_dirs:
        existing = sorted(directory.glob("*.ckpt")) if directory.is_dir() else []
        existing += sorted(run_dir.glob(HPC_CHECKPOINT_GLOB)) if run_dir.is_dir() else []
        if existing:
            raise ConfigError(f"{run_dir} already holds a run ({existing[0]}): resume it with --ckpt_path last, "
                              "or start a new run with --trainer.default_root_dir runs/NEW_NAME")
    return checkpoint_dirs


class RunCSVLogger(CSVLogger):
    """Lightning's CSVLogger with the steps of ``metrics.csv`` counted from 1, as the progress bar, the summary and
    the completion logs count them: Lightning logs the N-th training batch, and the validation after it, at N − 1."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics, None if step is None else step + 1)


def _note_unreached_validation(config) -> None:
    """One line when a step-counted validation interval is longer than the fit: Lightning skips it without a word."""
    trainer = config.trainer
    interval, max_steps = trainer.get("val_check_interval"), trainer.get("max_steps") or -1
    data = config.get("data")
    val_path = data.get("init_args", Namespace()).get("val_path", True) if isinstance(data, Namespace) else True
    if (isinstance(interval, int) and not isinstance(interval, bool) and trainer.get("check_val_every_n_epoch") is None
            and 0 < max_steps < interval and trainer.get("limit_val_batches") != 0 and val_path is not None
            and rank_zero_only.rank == 0):
        print(f"note: no validation in this fit: trainer.val_check_interval is {interval} steps and "
              f"trainer.max_steps {max_steps}; set --trainer.val_check_interval {max_steps} to validate at the end",
              file=sys.stderr, flush=True)


def _validation_done(run_dir: Path, step: int) -> list[str]:
    """What the fit that ended at ``step`` validated, by the config it saved (the newest ``version_N/config.yaml``
    of ``run_dir``): Lightning validates flowkit's endless training stream every ``val_check_interval`` steps, and
    not at all without validation data. ``[]`` where the config does not say (no saved config, an epoch schedule)."""
    saved = sorted(run_dir.glob("version_*/config.yaml"), key=lambda path: _version_number(path.parent))
    try:
        config = yaml.safe_load(saved[-1].read_text(encoding="utf-8")) if saved else None
    except (OSError, yaml.YAMLError):
        config = None
    if not isinstance(config, dict):
        return []
    trainer, data = config.get("trainer") or {}, config.get("data") or {}
    init_args = (data.get("init_args") or {}) if isinstance(data, dict) else {}
    if "val_path" in init_args and init_args["val_path"] is None:
        return ["not validated: no validation data"]
    if trainer.get("limit_val_batches") == 0:
        return ["not validated: trainer.limit_val_batches 0"]
    interval = trainer.get("val_check_interval")
    if not isinstance(interval, int) or isinstance(interval, bool) or trainer.get("check_val_every_n_epoch"):
        return []
    last = step // interval * interval
    if last == 0:
        return [f"not validated: trainer.val_check_interval {interval} > {step} steps"]
    return [f"validated at step {step}" if last == step else f"last validated at step {last}"]


def _version_number(directory: Path) -> int:
    """N of a logger's ``version_N`` directory (-1 for another name)."""
    number = directory.name.removeprefix("version_")
    return int(number) if number.isdigit() else -1


def _add_callback_unless_present(trainer, present: type, added: type) -> None:
    """Append an ``added`` callback (default arguments) to the trainer's unless the config names a ``present``."""
    callbacks = trainer.get("callbacks") or []
    if not any(isinstance(c, Namespace) and _is_subclass(c.get("class_path"), present) for c in callbacks):
        trainer.callbacks = [*callbacks, Namespace(class_path=f"{added.__module__}.{added.__qualname__}",
                                                   init_args=Namespace())]


def _is_subclass(class_path: str | None, base: type) -> bool:
    if not class_path:
        return False
    module, _, name = class_path.rpartition(".")
    try:
        return issubclass(getattr(importlib.import_module(module), name), base)
    except (ImportError, AttributeError, TypeError):
        return False


def run(args: list[str] | None, checkpoint: str) -> None:
    """Run :class:`FlowkitCLI` on ``args`` (``None``: ``sys.argv``), quiet about what a user cannot act on;
    ``checkpoint`` names the command's checkpoint in load errors."""
    # Lightning 2.6 on a newer torch: a deprecation inside Lightning's own pytree helper, nothing a user can act on.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # flowkit checkpoints the state after each RL step's optimizer steps on purpose: resume continues from there.
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    # Frozen models (proxies, evaluators, KL references) are in eval mode on purpose.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
    # DeepSpeed calls torch's collectives by their deprecated names on every ZeRO gather: not the user's to act on.
    warnings.filterwarnings("ignore", message=r"`torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)` is "
                                              r"deprecated")
    rank_zero_module.log.addFilter(_without_lightning_noise)
    if not sys.stderr.isatty():  # a bar redrawn in place is a stack of lines in a log ("Writing model shards")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    # Every checkpoint this command loads (Lightning's, DeepSpeed's under any strategy) is loaded tensors-only.
    with tensors_only_loading(checkpoint):
        # The parser raises instead of printing its usage and a nested error report: main() prints one line.
        FlowkitCLI(args=args, parser_kwargs={"exit_on_error": False})


# Lightning's info lines that tell a flowkit user nothing: the advertisement for its cloud logger at every start,
# and that a configured model summary (flowkit's ParameterSummary) replaces the default one.
LIGHTNING_NOISE = ("litlogger", "Skipping setting a default `ModelSummary` callback")


def _without_lightning_noise(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not any(noise in message for noise in LIGHTNING_NOISE)
