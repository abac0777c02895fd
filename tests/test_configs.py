"""Every YAML in configs/ parses and validates, a delta after its base (tests/config_layers.py); each is
instantiated on CPU as far as possible offline. `test_config_parses_and_validates` runs the `--print_config`
composition that docs/guides/configs.md shows, for every shipped config."""

import importlib.util
from pathlib import Path

import pytest
import yaml
from config_layers import base_of, config_args

from flowkit.cli import FlowkitCLI, main

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))

# Configs for hub models / GPUs: swap in offline stand-ins so the rest of the config is still instantiated.
CPU_OVERRIDES = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
                 "--trainer.precision", "32-true"]
OFFLINE_OVERRIDES = {
    "rlfr_qwen.yaml": CPU_OVERRIDES + ["--model.init_args.backbone", "bundled:tiny_adder",
                                       "--model.init_args.dtype", "float32",
                                       "--data.init_args.train_path", "bundled:arithmetic/train.jsonl"]
                      + ([] if importlib.util.find_spec("vllm") else ["--model.init_args.rollout.engine", "hf"]),
    "rlfr_qwen_official.yaml": CPU_OVERRIDES + ["--model.init_args.backbone", "bundled:tiny_adder",
                                                "--model.init_args.dtype", "float32",
                                                "--data.init_args.train_path", "bundled:arithmetic/train.jsonl"]
                               + ([] if importlib.util.find_spec("vllm") else ["--model.init_args.rollout.engine", "hf"]),
    "rlfr_qwen_tools.yaml": CPU_OVERRIDES + ["--model.init_args.backbone", "bundled:tiny_tool_adder",
                                             "--model.init_args.dtype", "float32",
                                             "--data.init_args.train_path", "bundled:long_addition/k3/train.jsonl"]
                            + ([] if importlib.util.find_spec("vllm") else ["--model.init_args.rollout.engine", "hf"]),
    "rlfr_qwen_offline.yaml": CPU_OVERRIDES + ["--model.init_args.backbone", "bundled:tiny_adder",
                                               "--model.init_args.dtype", "float32"],
    "explain_llama.yaml": CPU_OVERRIDES + ["--model.init_args.backbone", "bundled:explain_tiny/policy",
                                           "--model.init_args.reward_model.init_args.proxies",
                                           "[bundled:explain_tiny/proxy0, bundled:explain_tiny/proxy1, bundled:explain_tiny/proxy2]",
                                           "--model.init_args.dtype", "float32",
                                           "--model.init_args.reward_model.init_args.dtype", "float32"],
}


def test_there_are_configs():
    names = {p.name for p in CONFIGS}
    assert {"rlfr_tiny.yaml", "rlfr_qwen.yaml", "rlfr_qwen_official.yaml", "rlfr_qwen_offline.yaml"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_validates(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *config_args(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path" in printed and "trainer:" in printed


def resolved(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit):
        main(["fit", *args, "--print_config"])
    return yaml.safe_load(capsys.readouterr().out)


def leaves(tree, prefix: str = "") -> dict[str, object]:
    """``{dotted key: value}`` of a config, lists as values; ``class_path`` keys left out (a delta names no class)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {key: value for name, child in tree.items() if name != "class_path"
            for key, value in leaves(child, f"{prefix}.{name}" if prefix else name).items()}


@pytest.mark.parametrize("delta", [c for c in CONFIGS if base_of(c)], ids=lambda p: p.name)
def test_a_delta_changes_only_the_keys_it_sets(delta, capsys):
    """Over its base, a delta's keys are merged in, not a group or class swapped whole: every resolved value the
    delta does not set is its base's."""
    base, composed = resolved(config_args(base_of(delta)), capsys), resolved(config_args(delta), capsys)
    changed = {key for key, value in leaves(composed).items() if leaves(base).get(key, "absent") != value}
    assert changed and changed <= set(leaves(yaml.safe_load(delta.read_text())))


def test_a_delta_alone_is_a_one_line_error_naming_its_base(capsys):
    delta = next(c for c in CONFIGS if base_of(c))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(delta), "--print_config"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {delta} is a delta over configs/{base_of(delta).name}: give that first, "
        f"`--config configs/{base_of(delta).name} --config {delta}` (docs/guides/configs.md)")


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.name in OFFLINE_OVERRIDES or c.name.endswith("_tiny.yaml")],
                         ids=lambda p: p.name)
def test_config_instantiates_on_cpu(config, tmp_path, monkeypatch):
    monkeypatch.chdir(config.parent.parent)  # configs refer to configs/deepspeed relative to the repo
    args = [*config_args(config), "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path)]
    cli = FlowkitCLI(run=False, args=args + OFFLINE_OVERRIDES.get(config.name, []))
    assert cli.model is not None and cli.trainer is not None


def test_help_lists_flowkit_subcommands(capsys):
    main(["--help"])
    printed = capsys.readouterr().out
    for name in ["fit", "validate", "score", "export", "explain-rules"]:
        assert name in printed


def test_model_help_prints_every_option_group_with_its_declared_help(capsys):
    from flowkit.modules.policy_options import GROUPS
    from flowkit.options import option_help

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--model.help", "flowkit.modules.PolicyModule"])
    assert exit_info.value.code in (0, None)
    printed = " ".join(capsys.readouterr().out.split())
    for key, group in GROUPS.items():
        helps = option_help(group)
        for name in helps:  # a nested group (loss.rollout_correction) is listed by its own fields
            assert f"--model.{key}.{name} " in printed or f"--model.{key}.{name}." in printed, f"{key}.{name}"
        first = next(iter(helps))
        assert helps[first][:40] in printed, f"{key}.{first}'s help is not printed"
