"""`flowkit` command line: LightningCLI with flowkit's own subcommands.

Users add a subcommand with :func:`subcommand`: a function ``fn(trainer, model, datamodule, **options)``
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

import inspect
import os
import sys
import warnings
from collections.abc import Callable

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI

from flowkit.checkpointing import fault_tolerance_defaults

_SUBCOMMANDS: dict[str, Callable] = {}


def subcommand(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn(trainer, model, datamodule, **options)`` as ``flowkit NAME``."""

    def register(fn: Callable) -> Callable:
        _SUBCOMMANDS[name] = fn

        def method(self, model: LightningModule, datamodule: LightningDataModule | None = None, **options):
            return fn(self, model, datamodule, **options)

        # jsonargparse reads the options from the signature of the method it is given.
        params = list(inspect.signature(fn).parameters.values())
        if [p.name for p in params[:3]] != ["trainer", "model", "datamodule"]:
            raise TypeError(f"subcommand {name!r}: the first parameters must be (trainer, model, datamodule)")
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        method.__signature__ = inspect.Signature([self_param, *params[1:]])
        method.__doc__ = fn.__doc__
        method.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k != "trainer"}
        setattr(FlowkitTrainer, name, method)
        return fn

    return register


class FlowkitTrainer(Trainer):
    """Lightning's Trainer; flowkit subcommands are attached to it as methods by :func:`subcommand`."""


class FlowkitCLI(LightningCLI):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("trainer_class", FlowkitTrainer)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("trainer_defaults", fault_tolerance_defaults())
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        commands = dict(LightningCLI.subcommands())
        for name in _SUBCOMMANDS:
            commands[name] = {"model", "datamodule"}
        return commands


def _load_builtin_subcommands() -> None:
    import flowkit.commands  # noqa: F401  (registers flowkit's own subcommands)
    import flowkit.strategies  # noqa: F401  (registers the deepspeed_cpu* strategy names)


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Lightning 2.6 on a newer torch: a deprecation inside Lightning's own pytree helper, nothing a user can act on.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # flowkit checkpoints the state after each RL step's optimizer steps on purpose: resume continues from there.
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    _load_builtin_subcommands()
    try:
        FlowkitCLI(args=args)
    except Exception as err:
        cause = _input_error(err)
        if cause is None:
            raise
        sys.exit(f"error: {cause}")


def _input_error(err: BaseException) -> BaseException | None:
    """The bad-input error (bad model path, bad data record) behind ``err``, if any.

    jsonargparse and Lightning wrap exceptions raised while building or fitting the module; the user
    should see flowkit's one-line message, not that chain.
    """
    from flowkit.data.records import RecordError
    from flowkit.llm.backbone import BackboneError

    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (BackboneError, RecordError)):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None
