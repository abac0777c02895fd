"""Extending flowkit as a user does, through the `flowkit` console script in a subprocess: a plugin subcommand from
an installed package, project code imported from the working directory or a file, and the console's help and
one-line errors for typical mistakes."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import cli_errors

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "grpo_tiny.yaml"
# One RL step of 2 prompts × 2 samples of 8 tokens, no validation, no bar: seconds on the tiny model.
ONE_STEP = ["--trainer.max_steps", "1", "--model.init_args.sampling.num_samples", "2",
            "--model.init_args.sampling.max_new_tokens", "8",
            "--data.init_args.batch_size", "2", "--data.init_args.val_path", "null",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.callbacks", "[]"]


def flowkit(cwd: Path, *args: str, extra_path: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed ``flowkit`` script in ``cwd``, with flowkit (and ``extra_path``, e.g. a package's site
    directory) importable; never the tests' directory, so the project under ``cwd`` imports only as a user's would."""
    paths = [str(ROOT), *([str(extra_path)] if extra_path else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run([shutil.which("flowkit") or "flowkit", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def install_plugin(tmp_path: Path, entry_points: dict[str, str], files: dict[str, str]) -> Path:
    """Build the project ``my-project`` (``files`` and its ``flowkit.subcommands`` entry points) from a
    ``pyproject.toml`` and install it with pip, offline, into ``tmp_path/site``; return that site directory."""
    project = tmp_path / "my-project"
    for name, text in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(textwrap.dedent(text))
    points = "".join(f"{name} = {json.dumps(value)}\n" for name, value in entry_points.items())
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "my-project"\nversion = "0.1"\n\n'
        f'[project.entry-points."flowkit.subcommands"]\n{points}')
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-compile", "--no-index", "--target", str(site), str(project)],
                         env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
                         capture_output=True, text=True, timeout=120, check=False)
    assert pip.returncode == 0, pip.stderr[-3000:]
    return site


COUNT_PARAMS = '''
    def count_params(trainer, model, datamodule, trainable_only: bool = True):
        """Print the number of parameters of the configured model."""
        params = [p for p in model.parameters() if p.requires_grad or not trainable_only]
        print("parameters:", sum(p.numel() for p in params))
'''


def test_plugin_subcommand_is_listed_and_runs_with_the_config(tmp_path):
    site = tmp_path / "site"
    before = flowkit(tmp_path, "--help", extra_path=site)
    assert before.returncode == 0 and "count-params" not in before.stdout, before.stderr[-2000:]
    assert install_plugin(tmp_path, {"count-params": "my_project.commands:count_params"},
                          {"my_project/__init__.py": "", "my_project/commands.py": COUNT_PARAMS}) == site
    assert (site / "my_project-0.1.dist-info" / "RECORD").is_file()  # installed by pip, not written by the test
    listed = flowkit(tmp_path, "--help", extra_path=site)
    assert listed.returncode == 0 and "count-params" in listed.stdout, listed.stderr[-2000:]
    own_help = flowkit(tmp_path, "count-params", "--help", extra_path=site)
    assert own_help.returncode == 0, own_help.stderr[-2000:]
    assert "--trainable_only {true,false}" in own_help.stdout and "(type: bool, default: True)" in own_help.stdout
    assert "Print the number of parameters of the configured model." in own_help.stdout
    ran = flowkit(tmp_path, "count-params", "--config", str(CONFIG), "--trainable_only", "false", extra_path=site)
    assert ran.returncode == 0, ran.stderr[-3000:]
    count = int(ran.stdout.split("parameters:")[1].split()[0])
    assert count > 10_000  # the tiny adder's weights, built from the config's model section


def test_a_broken_plugin_is_one_warning_and_flowkit_still_runs(tmp_path):
    site = install_plugin(tmp_path, {"broken": "my_project.broken",
                                     "count-params": "my_project.commands:count_params",
                                     "fit": "my_project.commands:count_params"},  # a name flowkit's own command has
                          {"my_project/__init__.py": "", "my_project/commands.py": COUNT_PARAMS,
                           "my_project/broken.py": "import a_module_nobody_installed\n"})
    taken = ("warning: flowkit plugin 'fit' (my_project.commands:count_params) failed to load and is left out: "
             "'fit' is a command of flowkit itself; choose another name")
    broken = ("warning: flowkit plugin 'broken' (my_project.broken) failed to load and is left out: "
              "ModuleNotFoundError: No module named 'a_module_nobody_installed'")
    # the overview reads the plugins' names and loads none; a plugin's help loads them all
    for command, expected in (([], [taken]), (["count-params"], [taken, broken])):
        result = flowkit(tmp_path, *command, "--help", extra_path=site)
        assert result.returncode == 0, result.stderr[-2000:]
        assert [line for line in result.stderr.splitlines() if "plugin" in line] == expected, result.stderr
        assert "count-params" in result.stdout and "Traceback" not in result.stderr
    fit_help = flowkit(tmp_path, "fit", "--help", extra_path=site)  # flowkit's fit, not the plugin's
    assert fit_help.returncode == 0 and "--trainer.max_steps" in fit_help.stdout, fit_help.stderr[-2000:]
    for invoked in (["broken", "--help"], ["broken", "--config", str(CONFIG)]):  # each warning once, then the error
        result = flowkit(tmp_path, *invoked, extra_path=site)
        assert cli_errors.one_line_error(result) == ("error: command 'broken' is a plugin that failed to load (the "
                                                     "warning above says why)")
        assert sum("plugin 'broken'" in line for line in result.stderr.splitlines()) == 1, result.stderr
    misspelt = cli_errors.one_line_error(flowkit(tmp_path, "count-parms", "--help", extra_path=site))
    assert misspelt == ("error: unknown command 'count-parms'; did you mean 'count-params'? (the commands: fit, "
                        "validate, test, predict, convert-flow, explain-rules, export, score, count-params, docs, plot, "
                        "rollout-server; `flowkit --help` describes them)")


HOSTILE_PLUGINS = {
    "my_project/__init__.py": "",
    "my_project/exits.py": "import sys\nsys.exit(0)\n",
    "my_project/interrupts.py": "raise KeyboardInterrupt\n",
    "my_project/takes_over.py": '''
        import os
        from pathlib import Path

        from flowkit.registry import standalone, subcommand

        Path(os.environ["PLUGIN_MARKER"]).write_text("imported")


        @standalone("fit")
        def fake_fit(argv):
            print("the plugin's fit")


        @subcommand("export")
        def fake_export(trainer, model, datamodule):
            print("the plugin's export")


        @standalone("hello")
        def hello(argv):
            """say hello"""
            print("hello from the plugin", argv)
    ''',
}


def test_plugins_cannot_end_or_replace_flowkit_and_load_only_for_their_own_commands(tmp_path):
    site = install_plugin(tmp_path, {"exits": "my_project.exits", "interrupts": "my_project.interrupts",
                                     "takes-over": "my_project.takes_over"}, HOSTILE_PLUGINS)
    marker = tmp_path / "imported"
    os.environ["PLUGIN_MARKER"] = str(marker)  # the child's environment is this one's
    try:
        overview = flowkit(tmp_path, "--help", extra_path=site)
        fit_config = flowkit(tmp_path, "fit", "--config", str(CONFIG), "--print_config", extra_path=site)
        assert not marker.exists()  # neither the overview nor flowkit's own command imported a plugin
        hello = flowkit(tmp_path, "hello", "world", extra_path=site)
        registries = subprocess.run(
            [sys.executable, "-c", "from flowkit import cli; from flowkit.registry import STANDALONE, SUBCOMMANDS; "
                                   "import flowkit.commands.export; cli.load_plugins(); "
                                   "print(sorted(STANDALONE), SUBCOMMANDS['export'].__module__)"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])},
            capture_output=True, text=True, timeout=120, check=False)
    finally:
        del os.environ["PLUGIN_MARKER"]
    assert overview.returncode == 0 and overview.stderr == "", overview.stderr[-2000:]
    assert {"exits", "interrupts", "takes-over"} <= {line.split()[0] for line in overview.stdout.splitlines()
                                                     if line.startswith("  ") and line[2] != " "}
    assert fit_config.returncode == 0 and "the plugin's" not in fit_config.stdout, fit_config.stderr[-2000:]
    assert "trainer:" in fit_config.stdout
    assert hello.returncode == 0 and "hello from the plugin ['world']" in hello.stdout, hello.stderr[-2000:]
    assert hello.stderr.splitlines() == [
        "warning: flowkit plugin 'exits' (my_project.exits) failed to load and is left out: SystemExit: 0",
        "warning: flowkit plugin 'interrupts' (my_project.interrupts) failed to load and is left out: "
        "KeyboardInterrupt",
        "warning: flowkit plugin 'takes-over' (my_project.takes_over) registers 'export', a command of flowkit "
        "itself; flowkit's own 'export' runs",
        "warning: flowkit plugin 'takes-over' (my_project.takes_over) registers 'fit', a command of flowkit itself; "
        "flowkit's own 'fit' runs"], hello.stderr
    assert registries.returncode == 0, registries.stderr[-2000:]
    assert registries.stdout.split() == ["['hello']", "flowkit.commands.export"]  # flowkit's export, no plugin fit


PROJECT_REWARDS = '''
    def short_answer(completions, **columns):
        """1 for a completion of at most 4 characters."""
        return [float(len(c.strip()) <= 4) for c in completions]
'''


def test_project_code_imports_from_the_working_directory_and_from_a_file(tmp_path):
    (tmp_path / "my_project").mkdir()
    (tmp_path / "my_project" / "__init__.py").write_text("")
    # a module and a file that end their import as a script would: warnings, and the functions they defined run
    (tmp_path / "my_project" / "funcs.py").write_text(textwrap.dedent(PROJECT_REWARDS) + "raise KeyboardInterrupt\n")
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "length.py").write_text("import sys\n\ndef length(completions, **columns):\n"
                                                     "    return [float(len(c)) for c in completions]\n\nsys.exit(0)\n")
    # a file of the project named as one of flowkit's dependencies does not replace it
    (tmp_path / "yaml.py").write_text("from pathlib import Path\nPath('shadowed').write_text('')\n")
    functions = ('[{function: my_project.funcs.short_answer, weight: 0.1}, '
                 '{function: "rewards/length.py:length", weight: 0.0}]')
    with_validation_data = [arg for arg in ONE_STEP if arg not in ("--data.init_args.val_path", "null")]
    result = flowkit(tmp_path, "fit", "--config", str(CONFIG), *with_validation_data, "--trainer.default_root_dir",
                     "runs/own", "--model.init_args.reward_functions", functions,
                     "--trainer.callbacks", "[{class_path: flowkit.modules.ExportArtifacts}]")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "shadowed").exists()
    stops = {0: (tmp_path / "my_project" / "funcs.py", "KeyboardInterrupt()"),
             1: (tmp_path / "rewards" / "length.py", "SystemExit(0)")}
    for index, (module, stop) in stops.items():
        assert (f"warning: PolicyModule.reward_functions[{index}]: {module} raised {stop} when imported; flowkit goes "
                "on with what it defined before") in result.stderr.splitlines(), result.stderr[-3000:]
    # the export and the summary on one stream (stdout); no HF bar ("Writing model shards") in a log
    assert "fit summary: 1 step (0 → 1)" in result.stdout and "exported policy: " in result.stdout, result.stdout
    assert "exported" not in result.stderr and "Writing model shards" not in result.stderr
    # the config validates every 60 steps; this fit of 1 step says that it will not
    assert ("note: no validation in this fit: trainer.val_check_interval is 60 steps and trainer.max_steps 1; set "
            "--trainer.val_check_interval 1 to validate at the end") in result.stderr.splitlines()
    with open(tmp_path / "runs" / "own" / "version_0" / "metrics.csv") as f:
        logged = {key for row in csv.DictReader(f) for key, value in row.items() if value}
    assert {"train/reward/short_answer", "train/reward/length"} <= logged


USER_ALGORITHMS = '''
    from pathlib import Path

    import torch

    from flowkit.llm.engines import ROLLOUT_ENGINES
    from flowkit.llm.hf_engine import HFRolloutEngine
    from flowkit.llm.rollout_engine import EngineSpec
    from flowkit.rl.advantages import register_advantage
    from flowkit.rl.losses import aggregated, policy_metrics, register_policy_loss, token_ratio

    CALLS = Path("calls.txt")


    @register_policy_loss("advantage_clipped", advantage_clip=1.0)
    def advantage_clipped_policy_loss(logprobs, old_logprobs, advantages, mask, ctx):
        bound = ctx.args["advantage_clip"]
        with CALLS.open("a") as calls:
            calls.write(f"loss advantage_clip={bound}\\n")
        per_token = -token_ratio(logprobs, old_logprobs) * advantages.clamp(-bound, bound)
        return aggregated(per_token, mask, ctx), policy_metrics(logprobs, old_logprobs, mask, advantages.abs() > bound)


    @register_advantage("centered")
    def centered_outcome(rewards, group_ids, ctx):
        with CALLS.open("a") as calls:
            calls.write(f"estimator rows={len(rewards)}\\n")
        return rewards - rewards.mean()


    def build_logged_hf(setup):
        with CALLS.open("a") as calls:
            calls.write("engine built\\n")
        return HFRolloutEngine(setup.policy, setup.tokenizer, setup.max_new_tokens, setup.temperature, setup.top_p)


    ROLLOUT_ENGINES["logged_hf"] = EngineSpec(build_logged_hf)
'''
USER_SELECTION = """
model:
  init_args:
    advantage:
      estimator: my_algos.centered
    loss:
      policy_loss: my_algos.advantage_clipped
      policy_loss_args: {advantage_clip: 0.5}
    rollout:
      engine: my_algos.logged_hf
    update:
      skip_zero_advantage_rows: false  # the loss runs even when every outcome of the step was equal
"""


def test_a_loss_an_estimator_and_an_engine_registered_in_a_project_file_are_selected_from_a_yaml(tmp_path):
    """``my_algos.name`` imports the user's ``my_algos.py`` (the working directory is on ``sys.path``), whose
    registrations then name the loss (with its own hyper-parameter from the YAML), the estimator and the engine."""
    (tmp_path / "my_algos.py").write_text(textwrap.dedent(USER_ALGORITHMS))
    (tmp_path / "selection.yaml").write_text(USER_SELECTION)
    result = flowkit(tmp_path, "fit", "--config", str(CONFIG), "--config", "selection.yaml", *ONE_STEP,
                     "--trainer.default_root_dir", "runs/own_algorithms")
    assert result.returncode == 0, result.stderr[-3000:]
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls[0] == "engine built" and "estimator rows=4" in calls, calls  # 2 prompts × 2 samples
    assert "loss advantage_clip=0.5" in calls, calls
    misspelt = flowkit(tmp_path, "fit", "--config", str(CONFIG), "--config", "selection.yaml", *ONE_STEP,
                       "--model.init_args.loss.policy_loss", "my_algos.advantage_clip")
    assert cli_errors.one_line_error(misspelt) == (
        "error: PolicyModule.loss.policy_loss must be one of ppo, gspo, cispo, advantage_clipped, got "
        "'my_algos.advantage_clip': importing 'my_algos' registered no 'advantage_clip'"), misspelt.stderr[-2000:]
    unknown = flowkit(tmp_path, "fit", "--config", str(CONFIG), *ONE_STEP, "--model.init_args.advantage.estimator",
                      "rlo")
    assert cli_errors.one_line_error(unknown) == (
        "error: PolicyModule.advantage.estimator must be one of grpo, gae, reinforce, rloo, got 'rlo'; did you mean "
        "'rloo'?"), unknown.stderr[-2000:]


def test_a_reward_function_returning_a_dict_is_one_line_naming_it(tmp_path):
    (tmp_path / "bad.py").write_text("def by_index(completions, **columns):\n"
                                     "    return {i: 1.0 for i in range(len(completions))}\n")
    result = flowkit(tmp_path, "fit", "--config", str(CONFIG), *ONE_STEP, "--trainer.default_root_dir", "runs/bad",
                     "--model.init_args.reward_functions", '[{function: "bad.py:by_index"}]')
    line = cli_errors.one_line_error(result, max_lines=None)
    assert line == ("error: reward function 'by_index' must return a list or 1-D tensor of 4 numbers (None where it "
                    "does not apply), one per completion; it returned a dict"), line


def test_importing_the_cli_loads_neither_torch_nor_lightning():
    """Nor does the translation of the parser's errors, which :mod:`flowkit.lightning_cli` imports (not the CLI)."""
    probe = ("import sys, flowkit.cli, flowkit.parser_errors; "
             "print(sorted(m for m in ('torch', 'lightning', 'transformers', 'jsonargparse') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_typical_mistakes_are_one_line_with_the_nearest_name(tmp_path, capsys, monkeypatch):
    """The first mistake through the console script as a user meets it, the others in this process (the same
    :func:`flowkit.cli.main`, without a start-up of torch and Lightning each)."""
    typo = tmp_path / "typo.yaml"
    typo.write_text("trainer:\n  max_step: 3\n")
    run = ["fit", "--config", str(CONFIG), "--trainer.default_root_dir", str(tmp_path / "run")]
    cases = {
        ("--trainer.max_step", "3"):
            "error: unknown option --trainer.max_step; did you mean 'trainer.max_steps'?",
        ("--config", str(typo)):
            f"error: {typo}: unknown key 'trainer.max_step'; did you mean 'trainer.max_steps'?",
        ("--model.init_args.lrr", "1e-5"):
            "error: model.init_args: flowkit.modules.PolicyModule has no option 'lrr'; did you mean 'optim.lr'?",
        ("--model.class_path", "flowkit.modules.PolicyModul"):
            "error: model.class_path: cannot import 'flowkit.modules.PolicyModul' (module 'flowkit.modules' has no "
            "attribute 'PolicyModul'); did you mean 'flowkit.modules.PolicyModule'?",
        ("--optimizer", "torch.optim.SGD"):  # Lightning's option would replace PolicyModule's optimizer groups
            "error: unknown option --optimizer",
    }
    for i, (extra, expected) in enumerate(cases.items()):
        result = flowkit(tmp_path, *run, *extra) if i == 0 else \
            cli_errors.run_flowkit_in_process(tmp_path, ["flowkit", *run, *extra], capsys, monkeypatch)
        assert cli_errors.one_line_error(result) == expected, extra


def test_the_bundled_chat_model_and_conversational_data_run_offline(tmp_path):
    result = flowkit(tmp_path, "fit", "--config", str(CONFIG), *ONE_STEP, "--trainer.default_root_dir", "runs/chat",
                     "--model.init_args.backbone", "bundled:tiny_chat",
                     "--data.init_args.train_path", "bundled:arithmetic_chat/train.jsonl",
                     "--data.init_args.prompt_format", "chat",
                     "--trainer.callbacks", "[{class_path: flowkit.modules.CompletionLogs, init_args: {every_n_steps: 1}}]")
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [json.loads(line) for line in (tmp_path / "runs/chat/version_0/completions.jsonl").open()]
    # the template renders the user turn alone (system turns dropped): the tiny model's own prompt format
    assert logged and all(re.fullmatch(r"\d+\+\d+=", row["prompt"]) for row in logged), logged[0]["prompt"]
