"""`flowkit COMMAND --help` is built from the sources (flowkit.command_help), not by Lightning's parser: it must
list the options that parser takes, with the same defaults, and import neither torch nor Lightning."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

from flowkit import command_help
from flowkit.cli import main
from flowkit.registry import SUBCOMMANDS

# Set by flowkit's trainer defaults (fault_tolerance_defaults), which the parser shows and the built help describes
FLOWKIT_DEFAULTS = {"--trainer.plugins"}


def options(help_text: str) -> dict[str, str]:
    """``{option: its help block joined into one line}`` from an argparse help text (``+`` aliases left out)."""
    blocks: dict[str, str] = {}
    names: list[str] = []
    for line in help_text.splitlines():
        if re.match(r"  -", line):
            heading, _, rest = line[2:].partition("  ")
            names = [part.split()[0] for part in heading.split(", ") if not part.split()[0].endswith("+")]
            for name in names:
                blocks[name] = rest.strip()
        elif line.startswith("   ") and names:
            for name in names:
                blocks[name] = f"{blocks[name]} {line.strip()}".strip()
        else:
            names = []
    return blocks


def default(block: str) -> str | None:
    """The default a help block states (``required`` for a required option), or ``None``."""
    facts = block[max(block.rfind("(type: "), block.rfind("(required"), block.rfind("(default: ")):]
    if facts.startswith("(required"):
        return "required"
    found = re.search(r"default: (.+?)(?:, known subclasses: .*)?\)$", facts)
    return found.group(1) if found else None


def parser_help(command: str, capsys) -> str:
    import flowkit.commands
    from flowkit.lightning_cli import run

    flowkit.commands.load_all()

    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        run([command, "--help"], "")
    assert done.value.code == 0
    return capsys.readouterr().out


def built_help(command: str) -> str:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        main([command, "--help"])
    return text.getvalue()


@pytest.fixture
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")


@pytest.fixture
def launcher_subcommand(monkeypatch):
    """A subcommand a launcher registered (its function's signature, not flowkit's source, gives the options)."""
    def count_params(trainer, model, datamodule, trainable_only: bool = True, top: int | None = None,
                     out: str = "params.txt", tag: str = None):
        """Print the number of parameters.

        Args:
            trainable_only: count only trainable parameters.
            top: also list the largest ``top`` tensors.
        """

    monkeypatch.setitem(SUBCOMMANDS, "count-params", count_params)
    return "count-params"


def test_built_help_lists_the_parsers_options_with_its_defaults(capsys, wide_terminal, launcher_subcommand):
    commands = command_help.config_commands()
    assert {"fit", "validate", "test", "predict", "export", "score", launcher_subcommand} <= set(commands)
    for command in commands:
        expected, built = options(parser_help(command, capsys)), options(built_help(command))
        assert sorted(built) == sorted(expected), command
        assert len(expected) > 45, command  # the trainer's 41 options (and their .help) at least
        for name, block in expected.items():
            if name not in FLOWKIT_DEFAULTS:
                assert default(built[name]) == default(block), (command, name, block, built[name])
    fit = options(built_help("fit"))
    assert fit["--trainer.max_steps"].startswith("Stop training after this number of steps.")
    assert default(fit["--trainer.max_steps"]) == "-1" and default(fit["--ckpt_path"]) == "null"
    export = options(built_help("export"))
    assert default(export["--checkpoint"]) == "required" and default(export["--out"]) == "export"
    assert export["--overwrite"].startswith("replace a non-empty ``out`` whole")
    launched = options(built_help(launcher_subcommand))
    assert launched["--top"].startswith("also list the largest ``top`` tensors. (type: int | None, default: null)")


def test_help_names_where_the_models_options_are_and_flowkits_classes(wide_terminal):
    text = built_help("fit")
    assert text.startswith("usage: flowkit fit ")
    description = " ".join(text.split("\n\n")[1].split())
    assert description.startswith("Train the model: RL steps")
    assert "`flowkit fit --model.help flowkit.modules.PolicyModule`" in description
    blocks = options(text)
    assert "flowkit.modules.PolicyModule" in blocks["--model"] and "flowkit.modules.RolloutDataModule" in blocks["--data"]
    assert "flowkit.modules.RolloutDataModule" not in blocks["--model"]


def test_google_args_sections_are_read_entry_by_entry():
    doc = """Do a thing.

    Args:
        first: one line
            and its continuation.

        second (int): another.
        **options: the rest.

    Returns:
        nothing: at all.
    """
    assert command_help.argument_docs(doc) == {"first": "one line and its continuation.", "second": "another.",
                                                "**options": "the rest."}
    assert command_help.argument_docs("No sections.") == {}


def run_main(args: list[str]) -> subprocess.CompletedProcess:
    """``flowkit ARGS`` in a fresh interpreter, which then prints ``EXIT <code>`` (if main exited) and ``IMPORTED``
    followed by whichever of torch, Lightning, jsonargparse and transformers got imported."""
    code = (f"import sys; from flowkit.cli import main\ntry:\n    main({args!r})\nexcept SystemExit as e:\n"
            "    print('EXIT', e.code)\nprint('IMPORTED', *sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'lightning', 'jsonargparse', 'transformers'}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "100"})


@pytest.mark.parametrize("command", ["fit", "export", "plot"])
def test_help_imports_neither_torch_nor_lightning(command):
    result = run_main([command, "--help"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--help" in result.stdout and result.stdout.rstrip().splitlines()[-1] == "IMPORTED"


def test_the_option_names_are_the_parsers_aliases_included(monkeypatch, launcher_subcommand):
    """The names an unknown ``--trainer.NAME`` is checked against before Lightning loads (flowkit.cli) are the
    parser's, ``--NAME+`` (append to a list) included, so the nearest name it suggests is the parser's."""
    import flowkit.commands
    from flowkit.lightning_cli import FlowkitCLI, run

    flowkit.commands.load_all()
    parsers = {}

    def record(cli, parser, args):
        parsers.update(cli._subcommand_parsers)
        raise SystemExit(0)

    monkeypatch.setattr(FlowkitCLI, "parse_arguments", record)
    with pytest.raises(SystemExit):
        run(["fit"], "")
    assert set(parsers) == set(command_help.config_commands())
    for command, parser in parsers.items():
        names = {name[2:] for action in parser._actions for name in action.option_strings if name.startswith("--")}
        assert "trainer.callbacks+" in names and command_help.option_names(command) == names, command


MISTAKES = {
    ("fitt", "--help"): "error: unknown command 'fitt'; did you mean 'fit'? (the commands: fit, validate, test, "
                        "predict, convert-flow, explain-rules, export, score, docs, plot, rollout-server; `flowkit "
                        "--help` describes them)",
    ("fit", "--trainer.max_step", "3"): "error: unknown option --trainer.max_step; did you mean 'trainer.max_steps'?",
    ("export", "--trainer.acelerator=cpu"):
        "error: unknown option --trainer.acelerator; did you mean 'trainer.accelerator'?",
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_mistaken_command_or_trainer_option_is_one_line_before_torch_or_lightning_loads(mistake):
    result = run_main(list(mistake))
    assert result.stdout.splitlines() == ["EXIT 2", "IMPORTED"], result.stderr[-2000:]
    assert result.stderr.splitlines() == [MISTAKES[mistake]]
