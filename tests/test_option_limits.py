"""Option values the run's dtypes cannot hold, and option combinations that cannot make progress, are one line from
the ``flowkit`` command before any model loads."""

from pathlib import Path

import lightning  # noqa: F401  (imported here, its log handler holds the process's stderr, not one test's capture)
import pytest

from flowkit.cli import main

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "grpo_tiny.yaml")

CASES = {
    "overlong_penalty-1e300": (["controls.overlong_buffer_length", "4", "controls.overlong_penalty", "1e300"],
                               "PolicyModule.controls.overlong_penalty 1e+300 overflows float32, where it is used "
                               "(its square and a batch's sum must stay finite): at most 1e+15 in magnitude"),
    "lr-1e20": (["optim.lr", "1e20"], "PolicyModule.optim.lr 1e+20 overflows float32"),
    "kl_coef-1e-45": (["loss.kl_coef", "1e-45"], "PolicyModule.loss.kl_coef 1e-45 is subnormal or 0 in float32, where "
                                                  "it is used: 0 or at least 1.2e-38 in magnitude"),
    "max_new_tokens-1e10": (["sampling.max_new_tokens", "10000000000"],
                            "PolicyModule.sampling.max_new_tokens 10000000000 overflows int32, where it is used: at "
                            "most 2147483647 in magnitude"),
    "off_policy_mask-1e39": (["loss.rollout_correction.off_policy_mask", "1e39"],
                             "PolicyModule.loss.rollout_correction.off_policy_mask 1e+39 overflows float32"),
}


@pytest.mark.parametrize(("options", "expected"), CASES.values(), ids=CASES.keys())
def test_a_value_its_dtype_cannot_hold_is_one_line(tmp_path, monkeypatch, capsys, options, expected):
    monkeypatch.chdir(tmp_path)
    args = [arg for name, value in zip(options[::2], options[1::2]) for arg in (f"--model.init_args.{name}", value)]
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", CONFIG, "--trainer.max_steps", "0", *args])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: PolicyModule.") and expected in line, err
    assert not [*tmp_path.rglob("*.ckpt"), *tmp_path.rglob("metrics.csv")]  # refused before the run began
