"""scripts/rbrl_results.py: trained rows over training seeds, training-free rows over evaluation seeds, paired
differences per training seed, collapse diagnostics, and a study that resumes from its rows."""

import importlib.util
import json
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


def _row(seed: int, selector: list[float], sac: list[float], same: list[str] = ()) -> dict:
    return {
        "config": "toy", "arm": "paper", "seed": seed, "fit_seconds": 1.0, "eval_seeds": [1, 2],
        "returns": {"trained selector": selector, "trained selector (sampled)": [-6.0, -6.0],
                    "numeric SAC (raw state, no rules)": sac,
                    "random rule": [-3.0, -5.0], "fixed: a": [-1.0, -2.0], "fixed: b": [-9.0, -9.0]},
        "diagnostics": {"chosen": {"a": 1.0}, "agreement": {"a": 1.0, "b": 0.25}, "same_as_fixed_rule": list(same)},
        "curve": [{"step": 64, "episode_return": -2.0, "sampled_return": -4.0, "rule_entropy": 0.6},
                  {"step": 128, "episode_return": -1.0, "sampled_return": -7.0, "rule_entropy": 0.69}],
    }


def test_trained_rows_are_over_training_seeds_and_training_free_rows_over_evaluation_seeds(results_script):
    rows = [_row(0, [-1.0, -2.0], [-8.0, -6.0]), _row(1, [-2.0, -3.0], [-4.0, -4.0]), _row(2, [-1.5, -1.5], [-5.0, -7.0])]
    per_seed = results_script.trained_rows(rows)
    np.testing.assert_allclose(per_seed["trained selector"], [-1.5, -2.5, -1.5])
    np.testing.assert_allclose(per_seed["numeric SAC (raw state, no rules)"], [-7.0, -4.0, -6.0])
    text = results_script.table("toy", rows)
    sac_line = next(line for line in text.splitlines() if line.startswith("numeric SAC") and "training seeds" in line)
    # mean of (-7, -4, -6) = -5.667, sample std = 1.528
    assert "(3 training seeds)" in sac_line and "-5.667" in sac_line and "1.528" in sac_line
    random_line = next(line for line in text.splitlines() if line.startswith("random rule") and "eval seeds" in line)
    # over the 2 evaluation seeds: mean -4, std 1.414
    assert "(2 eval seeds)" in random_line and "-4.000" in random_line and "1.414" in random_line


def test_paired_differences_per_training_seed_with_a_t_interval(results_script):
    rows = [_row(0, [-1.0, -2.0], [-8.0, -6.0]), _row(1, [-2.0, -3.0], [-4.0, -4.0]), _row(2, [-1.5, -1.5], [-5.0, -7.0])]
    diffs = results_script.paired_differences(rows)
    np.testing.assert_allclose(diffs["random rule"], [2.5, 1.5, 2.5])  # selector − (−4) per training seed
    np.testing.assert_allclose(diffs["numeric SAC (raw state, no rules)"], [5.5, 1.5, 4.5])  # same seed paired
    np.testing.assert_allclose(diffs["fixed: a"], [0.0, -1.0, 0.0])
    # random rule: mean 2.167, std 0.577, 95 % half-width t(0.975, 2) · 0.577 / √3 = 4.303 · 0.333 = 1.434
    line = next(line for line in results_script.table("toy", rows).splitlines() if line.startswith("random rule") and "/" in line)
    assert "2.167" in line and "0.577" in line and "[  0.732,   3.601]" in line and line.endswith("3/3")


def test_collapse_diagnostics_are_reported_per_seed(results_script):
    rows = [_row(0, [-1.0, -2.0], [-8.0, -6.0], same=["a"]), _row(1, [-2.0, -3.0], [-4.0, -4.0])]
    text = results_script.table("toy", rows)
    seed0 = next(line for line in text.splitlines() if line.startswith("seed 0:"))
    assert "greedy -1.500, sampled -6.000" in seed0 and "rule entropy 0.60 → 0.69" in seed0
    assert "sampled curve -4.000 → -7.000" in seed0 and "chose a 100%" in seed0 and "SAME AS FIXED RULE a" in seed0
    assert "behaved as a fixed rule in 1/2 training seeds" in text


def test_training_free_rows_must_agree_and_trained_rows_must_be_in_every_fit(results_script):
    moved = _row(1, [-1.0, -2.0], [-8.0, -6.0])
    moved["returns"]["random rule"] = [-3.0, -4.0]
    with pytest.raises(ValueError, match="training-free rows differ between training seeds 0 and 1"):
        results_script.table("toy", [_row(0, [-1.0, -2.0], [-8.0, -6.0]), moved])
    without_sac = _row(1, [-1.0, -2.0], [0.0, 0.0])
    del without_sac["returns"]["numeric SAC (raw state, no rules)"]
    with pytest.raises(ValueError, match="training seed 1 has the trained rows"):
        results_script.trained_rows([_row(0, [-1.0, -2.0], [-8.0, -6.0]), without_sac])


def test_study_skips_fits_whose_rows_exist_and_reports_from_rows(results_script, tmp_path, monkeypatch):
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text(json.dumps(_row(0, [-1.0, -2.0], [-8.0, -6.0])) + "\n")
    fitted = []

    def fake_fit(config, arm, seed, root, sac_steps, ppo_transitions):
        fitted.append((Path(config).stem, arm, seed))
        return _row(seed, [-2.0, -3.0], [-4.0, -4.0])

    monkeypatch.setattr(results_script, "run_fit", fake_fit)
    monkeypatch.setattr(results_script, "plot_curves", lambda groups, path: None)
    monkeypatch.setattr("sys.argv", ["rbrl_results.py", "--configs", "configs/toy.yaml", "--seeds", "0", "1",
                                     "--arms", "paper", "--root", str(tmp_path)])
    results_script.main()
    assert fitted == [("toy", "paper", 1)]  # seed 0's row was already there
    assert [json.loads(line)["seed"] for line in rows_file.read_text().splitlines()] == [0, 1]
    assert "toy (paper): episode return" in (tmp_path / "results.md").read_text()
