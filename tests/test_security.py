"""Files flowkit reads decide no code: a checkpoint's hyper-parameters do not override the config (nor switch on
``trust_remote_code``), and DeepSpeed checkpoint directories are loaded as tensors only. Each attack is a file
built here whose payload would create a marker file; the marker must not exist afterwards."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import rlfr_run
import tiny_zero_job
import torch

from flowkit.checkpointing.safe_loading import UnsafeCheckpointError, consolidated_state_dict

ROOT = Path(__file__).resolve().parent.parent
TINY_ADDER = ROOT / "flowkit" / "assets" / "tiny_adder"


def flowkit(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("flowkit") or "flowkit", *args], env=rlfr_run.env(), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, check=False)


def remote_code_backbone(directory: Path, marker: Path) -> Path:
    """The tiny adder, plus ``auto_map`` custom code that creates ``marker`` when imported."""
    shutil.copytree(TINY_ADDER, directory)
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "payload.PayloadConfig", "AutoModelForCausalLM": "payload.PayloadModel"}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "payload.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import Qwen2Config, Qwen2ForCausalLM\n"
        "class PayloadConfig(Qwen2Config):\n    pass\n"
        "class PayloadModel(Qwen2ForCausalLM):\n    config_class = PayloadConfig\n"
    )
    return directory


def test_the_remote_code_payload_runs_when_trusted(tmp_path):
    """The payload is live: loading the backbone with trust_remote_code creates the marker (so its absence below
    means the code did not run, not that the payload is broken)."""
    from flowkit.llm.backbone import load_backbone

    marker = tmp_path / "marker"
    backbone = remote_code_backbone(tmp_path / "backbone", marker)
    load_backbone(str(backbone), trust_remote_code=False)
    assert not marker.exists()
    try:
        load_backbone(str(backbone), trust_remote_code=True)
    except Exception:  # noqa: BLE001 — the custom classes need not load; importing them is the attack
        pass
    assert marker.exists()


@pytest.mark.slow
def test_checkpoint_hyperparameters_neither_run_code_nor_override_the_command_line(tmp_path):
    rlfr_run.run(tmp_path, 1)
    (trained,) = tmp_path.rglob("checkpoints/last.ckpt")
    checkpoint = torch.load(trained, weights_only=True)
    marker = tmp_path / "marker"
    checkpoint["hyper_parameters"].update(
        backbone=str(remote_code_backbone(tmp_path / "backbone", marker)), trust_remote_code=True,
        validation={"temperature": 1.0, "num_samples": 4},
    )
    torch.save(checkpoint, tmp_path / "crafted.ckpt")

    result = flowkit(tmp_path, "validate", "--config", str(rlfr_run.CONFIG), "--ckpt_path", str(tmp_path / "crafted.ckpt"),
                     "--model.init_args.validation.temperature", "0", "--data.init_args.max_val_examples", "4",
                     "--trainer.default_root_dir", str(tmp_path / "validate"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert not marker.exists()
    # val_temperature 0 from the command line: one greedy sample, so pass@1 only (the checkpoint said 4 samples).
    assert "val/heldout/pass@1" in result.stdout and "pass@4" not in result.stdout


class Payload:
    """Unpickling it calls ``open(marker, "w")``: a harmless stand-in for any callable, e.g. ``os.system``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.fixture(scope="module")
def zero_checkpoints(tmp_path_factory) -> dict[int, Path]:
    """Real ZeRO-2 and ZeRO-3 checkpoint directories of the stand-in module (1 CPU process, 1 step)."""
    root = tmp_path_factory.mktemp("zero")
    checkpoints = {}
    for stage in (2, 3):
        checkpoints[stage] = root / f"zero{stage}"
        result = subprocess.run([sys.executable, tiny_zero_job.__file__, "--config", f"zero{stage}.json", "--optimizer",
                                 "adamw", "--save", str(checkpoints[stage]), "--out", str(root / f"out{stage}")],
                                env=rlfr_run.env(), cwd=root, capture_output=True, text=True, timeout=600, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
    return checkpoints


def with_payload(checkpoint: Path, copy: Path, file_kind: str, marker: Path) -> Path:
    """A copy of ``checkpoint`` whose ``*_{file_kind}_states.pt`` also holds a :class:`Payload`."""
    shutil.copytree(checkpoint, copy)
    (target,) = (copy / "checkpoint").glob(f"*_{file_kind}_states.pt")
    state = torch.load(target, weights_only=False)  # our own file, made above
    state["payload"] = Payload(marker)
    torch.save(state, target)
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("file_kind", ["model", "optim"])
def test_export_refuses_deepspeed_files_holding_objects(tmp_path, zero_checkpoints, stage, file_kind):
    clean = consolidated_state_dict(zero_checkpoints[stage])  # DeepSpeed's own types load
    assert set(clean) == {name for name, _ in tiny_zero_job.initial_module("sgd").named_parameters()}

    marker = tmp_path / "marker"
    crafted = with_payload(zero_checkpoints[stage], tmp_path / "crafted", file_kind, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"holds a pickled io\.open"):
        consolidated_state_dict(crafted)
    assert not marker.exists()


RESUME = """
import sys, types
import tiny_zero_job
args = types.SimpleNamespace(devices=1, config="zero2.json", batch_size=4)
tiny_zero_job.fit(tiny_zero_job.TwoGroupModule(optimizer="adamw"), args, 2, ckpt_path=sys.argv[1])
"""


@pytest.mark.slow
def test_fit_resume_under_deepspeed_refuses_files_holding_objects(tmp_path, zero_checkpoints):
    marker = tmp_path / "marker"
    crafted = with_payload(zero_checkpoints[2], tmp_path / "crafted", "model", marker)
    result = subprocess.run([sys.executable, "-c", RESUME, str(crafted)], env=rlfr_run.env(), cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode != 0
    assert "UnsafeCheckpointError: refusing to load checkpoint" in result.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_flowkit_export_of_a_crafted_directory_is_one_line(tmp_path, zero_checkpoints):
    marker = tmp_path / "marker"
    crafted = with_payload(zero_checkpoints[3], tmp_path / "crafted", "optim", marker)
    result = flowkit(tmp_path, "export", "--config", str(rlfr_run.CONFIG), "--checkpoint", str(crafted),
                     "--out", str(tmp_path / "export"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: refusing to load checkpoint '{crafted}'")
    assert not marker.exists() and not (tmp_path / "export").exists()


def test_checkpoint_files_load_tensors_and_allowed_types_only(tmp_path):
    from flowkit.llm.lora import LoraSettings

    module = torch.nn.Linear(2, 2)
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": {"lora": LoraSettings(r=4)}}, plain)
    assert consolidated_state_dict(plain).keys() == module.state_dict().keys()  # LoRA settings are allowed

    marker = tmp_path / "marker"
    crafted = tmp_path / "crafted.ckpt"
    torch.save({"state_dict": module.state_dict(), "callbacks": {"x": Payload(marker)}}, crafted)
    with pytest.raises(UnsafeCheckpointError, match=r"holds a pickled io\.open"):
        consolidated_state_dict(crafted)
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # the forcing ends with the load


def test_every_load_inside_a_flowkit_command_is_tensors_only(tmp_path, monkeypatch, capsys):
    """Whatever loads a checkpoint inside the CLI — here a stand-in asking for ``weights_only=False``, as DeepSpeed's
    loaders do under Lightning's own DeepSpeedStrategy — gets tensors only: one line, exit 2, no marker."""
    from flowkit import cli, lightning_cli

    marker = tmp_path / "marker"
    crafted = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(1)}, "payload": Payload(marker)}, crafted)
    monkeypatch.setattr(lightning_cli, "FlowkitCLI", lambda **_: torch.load(crafted, weights_only=False))
    with pytest.raises(SystemExit) as stopped:
        cli.main(["validate", "--ckpt_path", str(crafted)])
    assert stopped.value.code == 2
    assert not marker.exists()
    assert capsys.readouterr().err.strip() == (f"error: refusing to load checkpoint {str(crafted)!r}: it holds a pickled "
                                               "io.open; flowkit loads only tensors, plain data and DeepSpeed's own "
                                               "checkpoint types")
