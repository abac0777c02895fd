"""scripts/rbrl_results.py's table: trained rows over training seeds, training-free rows over evaluation seeds."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "rbrl_results.py"


@pytest.fixture(scope="module")
def results_script():
    spec = importlib.util.spec_from_file_location("rbrl_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(selector: list[float], sac: list[float]) -> dict:
    return {
        "trained selector": selector, "numeric SAC (raw state, no rules)": sac,
        "random rule": [-3.0, -5.0], "fixed: a": [-1.0, -2.0], "fixed: b": [-9.0, -9.0],
        "eval_seeds": [1, 2], "fit_seconds": 1.0, "curve": [],
    }


def test_trained_rows_are_over_training_seeds_and_training_free_rows_over_evaluation_seeds(results_script):
    runs = {0: _run([-1.0, -2.0], [-8.0, -6.0]), 1: _run([-2.0, -3.0], [-4.0, -4.0]), 2: _run([-1.5, -1.5], [-5.0, -7.0])}
    per_seed = results_script.trained_rows(runs)
    np.testing.assert_allclose(per_seed["trained selector"], [-1.5, -2.5, -1.5])
    np.testing.assert_allclose(per_seed["numeric SAC (raw state, no rules)"], [-7.0, -4.0, -6.0])
    text = results_script.table("toy", runs)
    sac_line = next(line for line in text.splitlines() if line.startswith("numeric SAC"))
    # mean of (-7, -4, -6) = -5.667, sample std = 1.528
    assert "(3 training seeds)" in sac_line and "-5.667" in sac_line and "1.528" in sac_line
    random_line = next(line for line in text.splitlines() if line.startswith("random rule"))
    # over the 2 evaluation seeds: mean -4, std 1.414
    assert "(2 eval seeds)" in random_line and "-4.000" in random_line and "1.414" in random_line
    assert "beats random rule choice in 3/3 training seeds" in text


def test_training_free_rows_must_agree_and_trained_rows_must_be_in_every_fit(results_script):
    moved = _run([-1.0, -2.0], [-8.0, -6.0]) | {"random rule": [-3.0, -4.0]}
    with pytest.raises(ValueError, match="training-free rows differ between training seeds 0 and 1"):
        results_script.table("toy", {0: _run([-1.0, -2.0], [-8.0, -6.0]), 1: moved})
    without_sac = {k: v for k, v in _run([-1.0, -2.0], [0.0, 0.0]).items() if not k.startswith("numeric")}
    with pytest.raises(ValueError, match="training seed 1 has the trained rows"):
        results_script.trained_rows({0: _run([-1.0, -2.0], [-8.0, -6.0]), 1: without_sac})
