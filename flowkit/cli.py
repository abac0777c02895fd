"""`flowkit` command line: LightningCLI with flowkit's own subcommands.

Every run lives in its run directory, ``trainer.default_root_dir`` (:func:`place_run`). Users add a subcommand
with :func:`subcommand` (from :mod:`flowkit.registry`, re-exported here): a function
``fn(trainer, model, datamodule, **options)``
whose extra keyword arguments (typed, with defaults) become the subcommand's options::

    from flowkit.cli import subcommand

    @subcommand("my-report")
    def my_report(trainer, model, datamodule, out: str = "report.txt"):
        \"\"\"Write a report.\"\"\"
        ...

then import that module before :func:`main` runs (e.g. in a ``my_package/__main__.py`` that calls
``flowkit.cli.main()``).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_module

from flowkit.checkpointing import (
    EXPORTED_KEY, HPC_CHECKPOINT_GLOB, VALIDATION_INTERRUPTED_KEY, RunDirectoryLock, checkpoint_metadata, fault_tolerance_defaults,
    lock_run_directory, newest_checkpoint, requeued_slurm_job, tensors_only_loading,
)
from flowkit.errors import ConfigError, RunError
from flowkit.modules.callbacks import ExportArtifacts
from flowkit.modules.completions import CompletionLogs
from flowkit.modules.summary import ParameterSummary, RunSummary
from flowkit.registry import STANDALONE, SUBCOMMANDS, subcommand

__all__ = ["FlowkitCLI", "FlowkitTrainer", "main", "subcommand"]

log = logging.getLogger(__name__)


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
    (:func:`~flowkit.checkpointing.resume_checkpoint`; Lightning's ``ckpt_path`` is set only when it restores it).
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
        if STANDALONE:  # `flowkit --help` names the commands that LightningCLI's parser does not know
            others = "; ".join(f"flowkit {name}: {(fn.__doc__ or '').strip().splitlines()[0]}"
                               for name, fn in STANDALONE.items())
            kwargs["parser_kwargs"] = {"epilog": f"other commands (each has --help): {others}",
                                       **(kwargs.get("parser_kwargs") or {})}
        self._run_lock: RunDirectoryLock | None = None
        try:
            super().__init__(*args, **kwargs)
        finally:
            if self._run_lock is not None:
                self._run_lock.release()

    def _parse_ckpt_path(self) -> None:
        """Keep the configuration the YAML files and the command line gave: a checkpoint supplies state only.

        LightningCLI would merge ``--ckpt_path``'s saved ``hyper_parameters`` over the parsed model config,
        which lets a checkpoint file override options the user typed (``--model.init_args.val_temperature 0``)
        and decide what code runs (``trust_remote_code: true`` with a ``backbone`` carrying custom code).
        """

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
            super().parse_arguments(parser, args)

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
        """Before any work of a resume: ``last`` is the newest of ``last*.ckpt`` and ``hpc_ckpt_N.ckpt``; a file that
        is no Lightning checkpoint, or one the model's config does not fit (``check_resume``), is one line; a run
        with nothing left to do (``max_steps`` reached, validated, exported) says so and ends, writing nothing."""
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
            step = checkpoint.get("global_step")
            print(f"nothing left to do: {path} is at step {step} of --trainer.max_steps {self.trainer.max_steps}, "
                  "and its fit ended (validated, exported); raise --trainer.max_steps to train further", flush=True)
            sys.exit(0)

    def _nothing_left(self, checkpoint: dict, path: Path) -> bool:
        """The checkpoint met ``max_steps``, no validation of it was interrupted, and the run (if it exports) wrote
        its export: before the checkpoint was saved (recorded in it) or after."""
        max_steps = self.trainer.max_steps
        if max_steps < 0 or int(checkpoint.get("global_step", -1)) < max_steps:
            return False
        states = checkpoint.get("callbacks") or {}
        if any(isinstance(state, dict) and state.get(VALIDATION_INTERRUPTED_KEY) for state in states.values()):
            return False
        if checkpoint.get(EXPORTED_KEY) or not any(isinstance(c, ExportArtifacts) for c in self.trainer.callbacks):
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
    Unless the config names its own logger, the run logs to ``<run dir>/version_N`` (a CSVLogger: ``metrics.csv``,
    the resolved ``config.yaml``, ``export/``); every ModelCheckpoint without a ``dirpath`` writes to
    ``<run dir>/checkpoints``, shared by the run's versions so ``--ckpt_path last`` resumes this run and no other.
    A fresh ``fit`` (no ``--ckpt_path``) into a run directory that already holds checkpoints is refused: two
    runs never share a checkpoint. Returns the checkpoint directories.
    """
    trainer = config.trainer
    run_dir = Path(trainer.default_root_dir or os.getcwd())
    if trainer.get("logger") in (None, True):
        trainer.logger = Namespace(class_path="lightning.pytorch.loggers.CSVLogger",
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


def _load_builtin_subcommands() -> None:
    import flowkit.commands  # noqa: F401  (registers flowkit's own subcommands)
    import flowkit.strategies  # noqa: F401  (registers the deepspeed_cpu* strategy names)


def main(args: list[str] | None = None) -> None:
    """Run the CLI; bad input (see :func:`_input_error`) prints ``error: <one line>`` and exits with code 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
    _load_builtin_subcommands()
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in STANDALONE:  # e.g. `flowkit plot RUN_DIR`: no config, model or trainer
        STANDALONE[argv[0]](argv[1:])
        return
    try:
        _check_config_files(argv)
        # Every checkpoint this command loads (Lightning's, DeepSpeed's under any strategy) is loaded tensors-only.
        with tensors_only_loading(_checkpoint_argument(argv)):
            # The parser raises instead of printing its usage and a nested error report: main() prints one line.
            FlowkitCLI(args=args, parser_kwargs={"exit_on_error": False})
    except Exception as err:
        message = _input_error(err)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


# Lightning's info lines that tell a flowkit user nothing: the advertisement for its cloud logger at every start,
# and that a configured model summary (flowkit's ParameterSummary) replaces the default one.
LIGHTNING_NOISE = ("litlogger", "Skipping setting a default `ModelSummary` callback")


def _without_lightning_noise(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not any(noise in message for noise in LIGHTNING_NOISE)


def _check_config_files(argv: list[str]) -> None:
    """Each ``--config`` file must be YAML; the parser would say only ``in "<unicode string>", line 2`` (not the file,
    nor that a tab indents it)."""
    import yaml

    for i, arg in enumerate(argv):
        name, sep, value = arg.partition("=")
        if name not in ("--config", "-c") or (not sep and i + 1 == len(argv)):
            continue
        path = Path(value if sep else argv[i + 1])
        if not path.is_file():  # the parser also takes the config itself as a string
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: cannot read the config file ({err})") from None
        try:
            yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            problem = " ".join((getattr(err, "problem", None) or str(err)).split())
            if mark is None:
                raise ConfigError(f"{path}: not YAML ({problem})") from None
            line = (text.splitlines() or [""])[min(mark.line, len(text.splitlines()) - 1)]
            tab = "; YAML indents with spaces, never tabs" if "\t" in line[:mark.column + 1] else ""
            raise ConfigError(f"{path}:{mark.line + 1}:{mark.column + 1}: {problem}{tab}") from None


def _checkpoint_argument(argv: list[str]) -> str:
    """The checkpoint named on the command line (``--ckpt_path`` / ``--checkpoint``), for error messages."""
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name in ("--ckpt_path", "--checkpoint"):
            return value or (argv[i + 1] if i + 1 < len(argv) else "")
    return "a checkpoint"


def _input_error(err: BaseException) -> str | None:
    """The one-line message of the bad-input error behind ``err``, or ``None`` if ``err`` is a bug.

    Bad input is a :class:`~flowkit.errors.ConfigError` (any module's option check), a
    :class:`~flowkit.data.records.RecordError`, a :class:`~flowkit.llm.backbone.BackboneError`, a value
    Lightning rejects (``MisconfigurationException``) or a command line / config the parser rejects; a
    :class:`~flowkit.errors.RunError` (a full disk, a run directory in use) is printed the same way.
    jsonargparse and Lightning wrap exceptions raised while building or fitting the module; the user
    should see the message that names the option, not that chain.
    """
    from argparse import ArgumentError

    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from flowkit.data.records import RecordError
    from flowkit.llm.backbone import BackboneError

    seen: set[int] = set()
    chain = []
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    for link in chain:
        if isinstance(link, (ConfigError, RunError, RecordError, BackboneError, MisconfigurationException)):
            return " ".join(str(link).split())
    if isinstance(chain[0], ArgumentError):
        return _parser_error_line(str(chain[0]))
    return None


_PARSER_REPORT_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:",
                        "Given value type:", "Given value:", "- Expected a <class 'NoneType'>")


def _parser_error_line(report: str) -> str:
    """jsonargparse's nested report (one block per Union alternative) → ``key.path: innermost message``.

    The innermost message is the most indented line that is not part of the report's scaffolding; the key
    path is the chain of ``Parser key`` lines above it (``init_args`` where it descends into a class).
    """
    path: list[tuple[int, str]] = []  # (indent, key) of the enclosing "Parser key" / class_path lines
    best: tuple[int, str, list[str]] | None = None
    for line in report.splitlines():
        text, indent = line.strip(), len(line) - len(line.lstrip())
        if not text or text.startswith(_PARSER_REPORT_NOISE):
            continue
        while path and path[-1][0] >= indent:
            path.pop()
        key = re.fullmatch(r'Parser key "(.+)":', text)
        if key or text.startswith("- Problem with given class_path"):
            path.append((indent, key.group(1) if key else "init_args"))
        elif best is None or indent > best[0]:
            best = (indent, text.removeprefix("- "), [k for _, k in path])
    if best is None:
        return " ".join(report.split())
    _, message, keys = best
    return f"{'.'.join(keys)}: {message}" if keys else message
