"""The README and the documentation pages say only what flowkit does: every `flowkit ...` command they show
parses, every option they name exists, every code block either runs in a test or says what it needs, and the site
builds in strict mode.

A code block is preceded by one marker line:

* ``<!-- runs in: FILE -->``: FILE (a test, or ``.ci/run``) runs it and names the page it reads it from;
* ``<!-- needs: WHAT -->``: it is not run here, because it needs WHAT (:data:`NEEDS`);
* ``<!-- shows: WHAT -->``: it is not a command (:data:`SHOWS`): output, a picture, a config or code excerpt;
* ``<!-- example: FILE NAMES -->``: the source of FILE, checked by ``tests/test_design_examples.py``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from flowkit.command_help import builtin_commands, config_commands, option_names, standalone_module
from flowkit.modules.policy_options import GROUPS
from flowkit.options import OptionGroup

ROOT = Path(__file__).resolve().parent.parent
# docs/design.md is the design's own page (its Python blocks are checked by tests/test_design_examples.py)
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "design.md")]
NEEDS = {
    "gpu": "a CUDA device",
    "download": "a hub model, a dataset or a package from the network",
    "your-data": "files the reader supplies (data, parameter files, responses to score)",
    "a-run": "the run directory or checkpoint an earlier command wrote",
    "minutes": "a full CPU job of minutes; CI runs a shortened form",
    "hours": "a study of many runs",
    "a-server": "a chat or rollout server the reader starts",
}
SHOWS = {"output", "picture", "config", "code", "record", "layout"}
MARKER = re.compile(r"<!-- (runs in|needs|shows|example): (.+?) -->")
FENCE = re.compile(r"^```(\w*)$")
# The plugin command the extending guide builds and installs (tests/test_extending.py installs one like it)
PLUGIN_EXAMPLES = {"count-params"}
COMMAND_LINE = re.compile(r"\s*(?:[A-Z_]+=\S*\s+)*flowkit\s")
INLINE_COMMAND = re.compile(r"`(flowkit [^`]+)`")
DEFAULT_CLASSES = {"model": "flowkit.modules.PolicyModule", "data": "flowkit.modules.RolloutDataModule"}


def code_blocks(path: Path) -> list[tuple[int, str, str | None, str]]:
    """``(line, language, marker or None, text)`` of each fenced block of ``path``; the marker is the last non-blank
    line before the fence, when it is one."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i].strip())
        if opening is None:
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = before if MARKER.fullmatch(before) else None
        blocks.append((i + 1, opening.group(1), marker, "\n".join(line[indent:] for line in lines[i + 1:end])))
        i = end + 1
    return blocks


def flowkit_commands(text: str) -> list[list[str]]:
    """The ``flowkit ...`` command lines of a shell block, continuation lines joined, as argument lists without
    ``flowkit``: environment assignments before it, a trailing ``&`` and comments dropped."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        if not COMMAND_LINE.match(line):
            continue
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words and words[0] == "flowkit":
            commands.append([word for word in words[1:] if word != "&"])
    return commands


def all_commands() -> list[tuple[str, list[str]]]:
    """Every ``flowkit ...`` command of the pages: in shell blocks, and inline (`` `flowkit fit --config X` ``;
    not a command's bare name, nor one that leaves words out with ``...`` or names a placeholder such as
    ``RUN_DIR``)."""
    found = []
    for path in PAGES:
        page = path.relative_to(ROOT)
        for line, language, _, text in code_blocks(path):
            if language in ("bash", ""):
                found += [(f"{page}:{line}", argv) for argv in flowkit_commands(text)]
        text = path.read_text(encoding="utf-8")
        for match in INLINE_COMMAND.finditer(text):
            command = " ".join(match.group(1).split())
            words = shlex.split(command)[1:]
            if len(words) < 2 or words[0].startswith("-"):  # a command's name (`flowkit plot`), `flowkit --help`
                continue
            if "..." not in command and not re.search(r"\b[A-Z][A-Z_]{2,}\b", command):
                found.append((f"{page}:{text.count(chr(10), 0, match.start()) + 1}", words))
    return found


# ------------------------------------------------------------------------------------------------ option checks
def group_keys(group: type, prefix: str) -> set[str]:
    """Every key of the option group ``group`` under ``prefix``, nested groups' included."""
    keys, hints = set(), typing.get_type_hints(group)
    for name, declared in group.__dataclass_fields__.items():
        if declared.init:
            keys.add(f"{prefix}.{name}")
            if isinstance(hints[name], type) and issubclass(hints[name], OptionGroup):
                keys |= group_keys(hints[name], f"{prefix}.{name}")
    return keys


def import_class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def unknown_init_arg(cls: type, parts: list[str], config: dict) -> str | None:
    """Why ``parts`` (the key after ``init_args.``) is no argument of ``cls``, or None; a nested object's own
    ``init_args`` are followed when ``config`` (the section's ``init_args`` in the YAML) names its class."""
    parameters = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return None
    name = parts[0]
    if name not in parameters:
        return f"{cls.__name__} takes no {name!r}"
    if cls.__name__ == "PolicyModule" and name in GROUPS:
        key = ".".join(parts)
        return None if len(parts) == 1 or key in group_keys(GROUPS[name], name) else f"no option {key!r}"
    nested = config.get(name) if isinstance(config, dict) else None
    if len(parts) > 2 and parts[1] == "init_args" and isinstance(nested, dict) and "class_path" in nested:
        return unknown_init_arg(import_class(nested["class_path"]), parts[2:], nested.get("init_args") or {})
    return None


def config_of(argv: list[str]) -> dict:
    for flag in ("--config", "-c"):
        if flag in argv:
            return yaml.safe_load((ROOT / argv[argv.index(flag) + 1]).read_text(encoding="utf-8")) or {}
    return {}


def unknown_options(command: str, argv: list[str]) -> list[str]:
    """The options of a config command's ``argv`` that its parser (``--trainer.*``, ``--config``, ...) or the model's
    and the data's classes (``--model.init_args.*``, ``--data.init_args.*``) do not take."""
    config, known, problems = config_of(argv), option_names(command), []
    for arg in argv:
        if not arg.startswith("--"):
            continue
        key = arg[2:].partition("=")[0]
        section, _, rest = key.partition(".")
        if section in DEFAULT_CLASSES and rest.startswith("init_args."):
            section_config = config.get(section) or {}
            cls = import_class(section_config.get("class_path", DEFAULT_CLASSES[section]))
            why = unknown_init_arg(cls, rest.split(".")[1:], section_config.get("init_args") or {})
            problems += [f"--{key}: {why}"] if why else []
        elif key not in known and ".".join(key.split(".")[:2]) not in known:
            problems.append(f"--{key}: no option of `flowkit {command}`")
    return problems


class Parsed(Exception):
    """Raised in place of running a standalone command once its own parser accepted the arguments."""


def parses_standalone(command: str, argv: list[str], monkeypatch) -> bool:
    from flowkit.registry import STANDALONE

    importlib.import_module(standalone_module(command))
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    try:
        STANDALONE[command](argv)
    except Parsed:
        return True
    except SystemExit:
        return False
    finally:
        monkeypatch.undo()
    return False


# ------------------------------------------------------------------------------------------------------- tests
def test_every_code_block_runs_in_a_test_or_says_why_not():
    problems, counted = [], 0
    for path in PAGES:
        page = str(path.relative_to(ROOT))
        for line, _, marker, _ in code_blocks(path):
            counted += 1
            where = f"{page}:{line}"
            if marker is None:
                problems.append(f"{where}: no marker line (<!-- runs in|needs|shows: ... -->) before the block")
                continue
            kind, value = MARKER.fullmatch(marker).groups()
            if kind == "needs" and not set(value.split(", ")) <= NEEDS.keys():
                problems.append(f"{where}: needs {value!r}; known: {', '.join(NEEDS)}")
            elif kind == "shows" and value not in SHOWS:
                problems.append(f"{where}: shows {value!r}; known: {', '.join(sorted(SHOWS))}")
            elif kind == "runs in":
                runner = ROOT / value
                text = runner.read_text(encoding="utf-8") if runner.is_file() else ""
                if page not in text and not (page == "README.md" and "README" in text):
                    problems.append(f"{where}: {value} does not exist or does not name {page}")
            elif kind == "example":
                problems.append(f"{where}: `example:` blocks belong to docs/design.md")
    assert counted > 30  # the scan found the pages' blocks
    assert problems == []


def test_the_readme_is_short_and_dates_live_only_in_the_results():
    """README.md is read in five minutes; dates, load averages and commit hashes belong to docs/results/."""
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200
    notebook = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|load average|\bat [0-9a-f]{7}\b")
    found = [f"{path.relative_to(ROOT)}:{number}" for path in PAGES if "results" not in path.parts
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if notebook.search(line)]
    assert found == []
    assert notebook.search("measured 2026-12-01 at 1d7748d, load average 4")


def test_the_scan_finds_commands_and_marks():
    sample = ("CUDA_VISIBLE_DEVICES=4 flowkit rollout-server --port 8000 &\n"
              "flowkit fit --config a.yaml \\\n    --x 1  # c")
    assert flowkit_commands(sample) == [["rollout-server", "--port", "8000"],
                                        ["fit", "--config", "a.yaml", "--x", "1"]]
    readme_blocks = code_blocks(ROOT / "README.md")
    assert "python -m pytest -q -n 2 --dist worksteal" in [text for _, _, _, text in readme_blocks]
    assert len(all_commands()) > 30


def test_every_flowkit_command_of_the_pages_parses(monkeypatch):
    standalone = {name for name, (kind, _) in builtin_commands().items() if kind == "standalone"}
    problems = []
    for where, argv in all_commands():
        command, args = argv[0], [arg for arg in argv[1:] if arg != "..."]
        if command in PLUGIN_EXAMPLES:
            continue
        if command in standalone:
            problems += [] if parses_standalone(command, args, monkeypatch) else [f"{where}: {shlex.join(argv)}"]
        elif command in config_commands():
            problems += [f"{where}: {problem}" for problem in unknown_options(command, args)]
        else:
            problems.append(f"{where}: no command {command!r}")
    assert problems == []


def test_the_command_check_finds_a_wrong_option(monkeypatch):
    good = ["--config", "configs/rlfr_tiny.yaml", "--model.init_args.sampling.temperature", "0.7",
            "--model.init_args.reward_model.init_args.scoring.beta", "0.2", "--trainer.max_steps", "3"]
    assert unknown_options("fit", good) == []
    assert unknown_options("fit", ["--config", "configs/rlfr_tiny.yaml", "--model.init_args.sampling.temprature",
                                   "0.7", "--trainer.max_step", "3", "--model.init_args.lr", "1",
                                   "--model.init_args.reward_model.init_args.bta", "0.2"]) == [
        "--model.init_args.sampling.temprature: no option 'sampling.temprature'",
        "--trainer.max_step: no option of `flowkit fit`",
        "--model.init_args.lr: PolicyModule takes no 'lr'",
        "--model.init_args.reward_model.init_args.bta: FlowReward takes no 'bta'"]
    assert parses_standalone("plot", ["runs/x", "--smooth", "5"], monkeypatch)
    assert not parses_standalone("plot", ["runs/x", "--smoth", "5"], monkeypatch)


# Option keys named in prose: `sampling.num_samples`, `model.init_args.loss.kl_coef`, `PolicyModule.optim.lr`
GROUP_KEY = re.compile(r"`(?:model\.init_args\.|PolicyModule\.)?((?:%s)\.[a-z_.]*[a-z_])[`: =]" % "|".join(GROUPS))
FILE_SUFFIXES = {"ckpt", "json", "jsonl", "md", "py", "safetensors", "yaml"}  # `flow_pretrain.ckpt` is a file
# The options page's one example of the flat form of earlier versions, which is an error on purpose
ON_PURPOSE = "is a one-line error naming the new key"


def test_every_option_group_key_the_pages_name_exists():
    keys = set().union(*(group_keys(group, prefix) for prefix, group in GROUPS.items()))
    problems = []
    for path in PAGES:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if ON_PURPOSE in line:
                continue
            problems += [f"{path.relative_to(ROOT)}:{number}: {key}" for key in GROUP_KEY.findall(line)
                         if key not in keys and key.rpartition(".")[2] not in FILE_SUFFIXES]
    assert keys and problems == []
    assert GROUP_KEY.findall("see `loss.rollout_correction.cap: 2` and `model.init_args.optim.lr`") == [
        "loss.rollout_correction.cap", "optim.lr"]


def test_the_config_blocks_name_options_that_exist():
    """A YAML block of a page that sets ``model.init_args`` sets PolicyModule's options (groups and keys)."""
    from flowkit.modules import PolicyModule

    checked, problems = 0, []
    for path in PAGES:
        for line, language, _, text in code_blocks(path):
            if language != "yaml":
                continue
            init_args = ((yaml.safe_load(text) or {}).get("model") or {}).get("init_args") or {}
            for key, value in init_args.items():
                parts = [key, *(value if key in GROUPS and isinstance(value, dict) else {})]
                for sub in parts[1:] or [None]:
                    why = unknown_init_arg(PolicyModule, [key, sub] if sub else [key], init_args)
                    problems += [f"{path.relative_to(ROOT)}:{line}: {why}"] if why else []
                checked += 1
    assert checked >= 5 and problems == []


def test_the_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "reference" / "options" / "index.html").is_file()
