"""The rule-bottleneck (RBRL) and explanation methods stay behind their own boundaries: importing flowkit, its
modules or its rewards, and an RLFR fit, load neither method nor gymnasium (RBRL's, the ``rbrl`` extra). Each case
runs in a fresh interpreter under ``python -X importtime``, whose log names every module the process imported,
deferred imports included."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RLFR_TINY_ONE_STEP = ["-m", "flowkit", "fit", "--config", str(ROOT / "configs" / "rlfr_tiny.yaml"),
                      "--model.init_args.flow_pretrain.steps", "0", "--model.init_args.sampling.num_samples", "2",
                      "--data.init_args.batch_size", "2", "--trainer.enable_model_summary", "false",
                      "--trainer.max_steps", "1", "--trainer.default_root_dir", "run"]


def imported(args: list[str], cwd: Path) -> set[str]:
    """The modules ``python -X importtime ARGS`` imports (its import log is on stderr)."""
    result = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True,
                            timeout=600, cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return {line.rpartition("|")[2].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}


def methods(modules: set[str]) -> list[str]:
    return sorted(name for name in modules
                  if name.split(".")[0] == "gymnasium" or name.startswith(("flowkit.rbrl", "flowkit.explain")))


@pytest.mark.parametrize("package", ["flowkit", "flowkit.modules", "flowkit.rewards"])
def test_importing_flowkit_loads_no_method(package, tmp_path):
    modules = imported(["-c", f"import {package}"], tmp_path)
    assert package in modules
    assert not methods(modules)


def test_an_rlfr_fit_loads_no_method(tmp_path):
    modules = imported(RLFR_TINY_ONE_STEP, tmp_path)
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()  # the step ran
    assert "flowkit.modules.policy" in modules
    assert not methods(modules)


def test_a_method_class_path_loads_its_method(tmp_path):
    """What configs name (``flowkit.modules.SelectorModule``, ``flowkit.rewards.ExplanationReward``) still resolves,
    and then the log does show the method and gymnasium."""
    code = "import flowkit.modules, flowkit.rewards; flowkit.modules.SelectorModule; flowkit.rewards.ExplanationReward"
    modules = imported(["-c", code], tmp_path)
    assert {"flowkit.rbrl", "flowkit.explain", "gymnasium"} <= set(methods(modules))


def test_an_rbrl_config_without_the_rbrl_extra_fails_in_one_line(tmp_path):
    config = ROOT / "configs" / "rbrl_binpacking.yaml"
    code = ("import sys; sys.modules['gymnasium'] = None; from flowkit.cli import main; "  # gymnasium not installed
            f"main(['fit', '--config', {str(config)!r}, '--print_config'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("needs gymnasium (import of gymnasium halted; None in "
                                                           "sys.modules); install it with `pip install flowkit[rbrl]`")
