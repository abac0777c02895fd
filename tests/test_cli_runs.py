"""Runs never collide, one seed varies everything, the progress bar reads well in a log, and the CLI's structure.

The runs are the tiny RLFR config shrunk to a step or two of 2 prompts × 2 samples (a few seconds each).
"""

import ast
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from flowkit.cli import FlowkitCLI, main
from flowkit.modules.datamodule import PromptStream

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "rlfr_tiny.yaml")
SHORT = ["--model.init_args.flow_pretrain.steps", "0", "--model.init_args.sampling.num_samples", "2",
         "--data.init_args.batch_size", "2", "--trainer.enable_model_summary", "false"]


def fit(run_dir: Path, steps: int, *extra: str) -> None:
    main(["fit", "--config", CONFIG, *SHORT, "--trainer.default_root_dir", str(run_dir),
          "--trainer.max_steps", str(steps), *extra])


def test_two_runs_never_share_a_checkpoint_and_last_resumes_the_named_run(tmp_path, monkeypatch, capsys, single_thread):
    monkeypatch.chdir(tmp_path)
    fit(Path("runs/a"), 1)
    fit(Path("runs/b"), 1)
    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    for run in (a, b):  # logs, config, checkpoint and exports of a run live together under its directory
        assert {p.name for p in (run / "checkpoints").iterdir()} == {"last.ckpt"}
        for artifact in ["metrics.csv", "config.yaml", "export/flow.safetensors", "export/hf_policy/config.json"]:
            assert (run / "version_0" / artifact).is_file(), (run, artifact)
    assert not (tmp_path / "lightning_logs").exists()
    saved = yaml.safe_load((a / "version_0" / "config.yaml").read_text())["trainer"]
    assert saved["logger"] is None and saved["callbacks"][0]["init_args"]["dirpath"] is None  # reusable elsewhere
    b_checkpoint = (b / "checkpoints" / "last.ckpt").read_bytes()

    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # a fresh run into a used directory would overwrite its last.ckpt
        fit(Path("runs/a"), 1)
    assert refused.value.code == 2
    assert "runs/a already holds a run" in capsys.readouterr().err

    fit(Path("runs/a"), 2, "--ckpt_path", "last")
    resumed = torch.load(a / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 2  # continued run a's step-1 checkpoint
    assert (a / "version_1" / "metrics.csv").is_file()
    assert (b / "checkpoints" / "last.ckpt").read_bytes() == b_checkpoint  # run b untouched


def cli(tmp_path: Path, *extra: str) -> FlowkitCLI:
    return FlowkitCLI(run=False, args=["--config", CONFIG, *SHORT, "--trainer.logger", "false",
                                       "--trainer.default_root_dir", str(tmp_path), *extra])


def test_one_seed_varies_prompt_order_and_reward_noise_unless_pinned(tmp_path, single_thread):
    runs = {seed: cli(tmp_path, "--seed_everything", str(seed)) for seed in (1, 2)}
    pinned = cli(tmp_path, "--seed_everything", "2", "--data.init_args.seed", "1",
                 "--model.init_args.reward_model.init_args.seed", "1")

    def first_prompts(run: FlowkitCLI) -> list[str]:
        run.datamodule.setup("fit")
        return PromptStream(run.datamodule.train_records, 8, run.datamodule.seed).batch(0)["prompt"]

    def deviations(run: FlowkitCLI, field_from: FlowkitCLI) -> torch.Tensor:
        """Deviation scores of fixed latents with one shared field: they differ only by the reward noise."""
        reward = run.model.reward_model
        reward.field.load_state_dict(field_from.model.reward_model.field.state_dict())
        hidden = run.model.policy.config.hidden_size
        latents = torch.randn(len(reward.percentiles), 2, 5, hidden, generator=torch.Generator().manual_seed(0))
        return reward.deviation_scores(latents, torch.ones(2, 5), reward.seed)

    assert [runs[s].datamodule.seed for s in (1, 2)] == [1, 2]
    assert [runs[s].model.reward_model.seed for s in (1, 2)] == [1, 2]
    assert first_prompts(runs[1]) != first_prompts(runs[2])
    assert not torch.equal(deviations(runs[1], runs[1]), deviations(runs[2], runs[1]))
    # A part pinned on purpose keeps its own seed whatever --seed_everything says.
    assert pinned.datamodule.seed == 1 and pinned.model.reward_model.seed == 1
    assert first_prompts(pinned) == first_prompts(runs[1])
    assert torch.equal(deviations(pinned, runs[1]), deviations(runs[1], runs[1]))


def test_progress_is_one_readable_line_when_stdout_is_not_a_terminal(tmp_path, monkeypatch, capsys, single_thread):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path / "run", 2, "--trainer.callbacks+=flowkit.modules.progress.RLProgressBar",
            "--trainer.callbacks.line_every_n_steps", "1", "--model.init_args.flow_pretrain.steps", "20")
    out = capsys.readouterr().out
    assert "\r" not in out
    pretraining = [line.split(" | ") for line in out.splitlines() if line.startswith("flow pretraining")]
    assert [fields[0] for fields in pretraining] == [f"flow pretraining {done}/20" for done in range(2, 21, 2)]
    assert all(fields[1].startswith("loss ") and fields[2].endswith(" s") for fields in pretraining)
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2
    for step, line in enumerate(lines, start=1):
        fields = line.split(" | ")
        assert fields[0] == f"step {step}/2"
        assert [f.split(" ")[0] for f in fields[1:-1]] == ["reward", "acc", "flow_nz", "tok/s"]
        assert fields[-1].endswith(" s")
    assert "Epoch" not in line and "v_num" not in line
    messages = [str(w.message) for w in caught]
    # Neither warning a user cannot act on: the policy's modes (HF loads in eval mode) and pytest's own argv.
    assert not [m for m in messages if "in eval mode" in m or "args parameter is intended" in m], messages


def run_on_a_terminal(args: list[str], timeout: float = 600) -> str:
    """The output of ``python -m flowkit ARGS`` with stdout and stderr on a 120-column pseudo-terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "flowkit", *args], stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            elif process.poll() is not None:
                break
        assert process.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, b"".join(chunks)[-3000:]
    finally:
        process.kill()
        os.close(master)
    return b"".join(chunks).decode("utf-8", "replace")


def screen(out: str) -> list[str]:
    """What a terminal shows after ``out``: carriage return, newline and cursor-up (tqdm's controls) applied."""
    rows, row, col = [[]], 0, 0
    for token in re.findall(r"\x1b\[(\d*)A|(\r)|(\n)|([^\r\n\x1b]+)", out):
        up, carriage_return, newline, text = token
        if carriage_return:
            col = 0
        elif newline:
            row, col = row + 1, 0
            rows.extend([] for _ in range(row + 1 - len(rows)))
        elif text:
            line = rows[row]
            line.extend(" " * (col - len(line)))
            line[col:col + len(text)] = text
            col += len(text)
        else:
            row = max(0, row - int(up or 1))
    return ["".join(line).rstrip() for line in rows if "".join(line).strip()]


def test_the_step_bar_is_drawn_once_on_a_terminal_and_closed_before_the_end_of_fit_lines(tmp_path):
    out = run_on_a_terminal(["fit", "--config", CONFIG, *SHORT, "--trainer.max_steps", "2",
                             "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(tmp_path / "run")])
    shown = screen(out)
    bars = [line for line in shown if line.startswith("step:")]
    assert len(bars) == 1 and "2/2" in bars[0], shown
    assert bars[0].rstrip().endswith("]"), bars  # the bar alone: nothing printed onto its line

    def first(prefix: str) -> int:
        return next(i for i, line in enumerate(shown) if line.startswith(prefix))

    assert shown.index(bars[0]) < first("`Trainer.fit` stopped") < first("exported policy") < first("fit summary")


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_commands_and_cli_meet_only_in_the_registry():
    registry = ROOT / "flowkit" / "registry.py"
    assert not [n for n in imports(registry) if n.startswith("flowkit")]
    for path in (ROOT / "flowkit" / "commands").glob("*.py"):
        assert "flowkit.cli" not in imports(path), path
    cli_top_level = {n for node in ast.parse((ROOT / "flowkit" / "cli.py").read_text()).body
                     if isinstance(node, (ast.Import, ast.ImportFrom)) for n in imports_of(node)}
    assert not [n for n in cli_top_level if n.startswith("flowkit.commands")]  # loaded lazily by main()


def imports_of(node: ast.AST) -> list[str]:
    return [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def test_user_subcommands_still_register_through_flowkit_cli(capsys):
    from flowkit.cli import subcommand

    @subcommand("count-params")
    def count_params(trainer, model, datamodule, trainable_only: bool = True):
        """Print the number of parameters of the configured model."""
        print(sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only))

    main(["count-params", "--help"])
    assert "--trainable_only" in capsys.readouterr().out
    with pytest.raises(TypeError, match="first parameters must be"):
        subcommand("bad")(lambda model, trainer, datamodule: None)
    main(["--help"])
    overview = capsys.readouterr().out
    assert "count-params    Print the number of parameters" in overview  # a launcher's subcommand is listed
    assert "plot            draw a run's training curves" in overview


def test_flowkit_help_lists_every_command_without_importing_torch_or_lightning():
    import flowkit.commands
    from flowkit.registry import STANDALONE, SUBCOMMANDS

    flowkit.commands.load_all()  # registers the built-in commands, to compare with

    code = ("import sys; from flowkit.cli import main; main(['--help']); "
            "print('IMPORTED', *sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning', 'transformers'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COLUMNS": "100"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.rstrip().splitlines()[-1] == "IMPORTED"
    listed = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ") and line[2] != " "}
    builtin = {name for name, fn in {**SUBCOMMANDS, **STANDALONE}.items() if fn.__module__.startswith("flowkit.")}
    assert listed == {"fit", "validate", "test", "predict", *builtin}
