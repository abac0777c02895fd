"""HeatAlerts: weather2alert's reward, budget and alert history on the synthetic stand-in, and the loader of the real
data and posterior files (here written by the test in weather2alert's layout)."""

import math

import numpy as np
import pytest

from flowkit.errors import ConfigError
from flowkit.rbrl.envs import make_env
from flowkit.rbrl.heatalerts import REWARD_SCALE, HeatAlertsEnv, SyntheticCounties, heat_features, us_holidays
from flowkit.rbrl.templates import TemplateRuleSource


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def expected_reward(env: HeatAlertsEnv, action: int) -> float:
    """weather2alert's _get_reward, written out: −1000/152 · σ(β·x) · (1 − σ(γ·x) · [heat_qi > 0.5] · a)."""
    f = env.features()
    b = sigmoid(sum(v * f[k] for k, v in env.summer.baseline.items()))
    e = sigmoid(sum(v * f[k] for k, v in env.summer.effectiveness.items())) * (f["heat_qi"] > 0.5)
    return -REWARD_SCALE * b * (1 - e * action)


def test_reward_budget_and_alert_history_follow_weather2alert():
    lang = make_env("heatalerts", budget=2, horizon=10)
    env = lang.env.unwrapped
    lang.reset(seed=3)
    rewards = []
    for action in (1, 1, 1, 0):
        expected = expected_reward(env, action) if env.remaining_budget > 0 or action == 0 else -1.0
        _, reward, terminated, truncated, info = lang.step(action)
        assert reward == pytest.approx(expected) and not terminated and not truncated
        rewards.append(reward)
    assert rewards[2] == -1.0  # the third alert is over the budget of 2: not issued, penalised
    assert env.alerts == [1, 1, 0, 0] and env.remaining_budget == 0
    assert env.history_features() == {"alert_lag1": 0.0, "alerts_2wks": 2.0, "alert_streak": 0.0, "remaining_budget": 0.0}
    assert list(lang.valid_actions()) == [0] and "remaining budget is zero" in lang.describe()
    for _ in range(6):
        *_, truncated, _ = lang.step(0)
    assert truncated and env.t == 10  # the official 32-day TimeLimit, here 10


def test_an_alert_helps_only_on_days_hotter_than_the_median_and_less_after_alerts():
    env = HeatAlertsEnv()
    env.reset(seed=0)
    summer = env.summer
    cool = int(np.argmin(summer.features["heat_qi"]))
    env.start, env.t = cool, 0
    assert env.reward_of(1) == env.reward_of(0)  # heat_qi ≤ 0.5: an alert changes nothing
    hot = int(np.argmax(summer.features["heat_qi"]))
    env.start, env.t, env.alerts = hot, 0, []
    fresh = env.reward_of(1) - env.reward_of(0)  # hospitalisations an alert prevents today (per 1000)
    env.alerts = [1] * 5  # alert fatigue: yesterday's alert and 5 in two weeks
    assert 0 < env.reward_of(1) - env.reward_of(0) < fresh


def test_synthetic_heat_index_percentile_is_the_county_climate_and_features_match_weather2alert():
    counties = SyntheticCounties()
    rng = np.random.default_rng(0)
    qi = np.concatenate([counties.summer(rng).features["heat_qi"] for _ in range(200)])
    assert abs(qi.mean() - 0.5) < 0.03 and abs((qi > 0.9).mean() - 0.1) < 0.02  # percentiles of its own climate
    features = heat_features(np.array([0.9, 1.0, 0.8]), np.array([0.2, 0.8, 0.5]))
    np.testing.assert_allclose(features["heat_qi_3d"], [0.2, 0.5, 0.5])
    np.testing.assert_allclose(features["excess_heat_3d"], [0.0, 0.3, 0.0])
    np.testing.assert_allclose(features["heat_qi_above_75"], [0.0, 0.8, 0.0])
    assert {d.isoformat() for d in us_holidays(2011)} == {"2011-05-30", "2011-07-04", "2011-09-05"}


def test_description_is_the_same_however_often_it_is_rendered_and_rules_are_executable():
    lang = make_env("heatalerts")
    lang.reset(seed=5)
    first = lang.prompt()
    assert lang.prompt() == first and "Heat forecast for the next days" in first and "Remaining warnings (budget): 10" in first
    source = TemplateRuleSource("heatalerts")
    for _ in range(32):
        rules = source.generate(lang)
        assert len(rules) == 8 and all(r.preferred[0] in lang.valid_actions() for r in rules)
        _, _, _, truncated, _ = lang.step(rules[0].preferred[0])
        if truncated:
            break


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"simulator": "official"}, "heatalerts env_kwargs.simulator must be one of"),
    ({"budget": -1}, "heatalerts needs budget >= 0"),
    ({"simulator": "weather2alert"}, "needs env_kwargs.data_dir"),
])
def test_bad_options_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        HeatAlertsEnv(**kwargs)


# ----------------------------------------------------------------------------- the real files' loader


def write_weather2alert_files(root, days: int = 40):
    """Two counties × two summers in weather2alert's Hugging Face layout, posterior of 3 samples."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    rows = {"fips": [], "date": []}
    exo = {k: [] for k in ("heat_qi", "hi_max", "heat_qi_3d", "heat_qi_7d", "excess_heat_3d", "excess_heat_7d",
                           "heat_qi_above_75", "weekend", "holiday", "dos")}
    for fips in ("06037", "04013"):
        for year in (2007, 2011):
            qi = rng.uniform(0, 1, days)
            f = heat_features(rng.uniform(0.7, 1.1, days), qi)
            for d in range(days):
                rows["fips"].append(fips)
                rows["date"].append(f"{year}-{5 + d // 31:02d}-{1 + d % 31:02d}")
                for k in exo:
                    exo[k].append(float(f[k][d]) if k in f else float(d if k == "dos" else rng.integers(2)))
    (root / "data" / "65k").mkdir(parents=True)
    pq.write_table(pa.table(rows | exo), root / "data" / "65k" / "exogenous_states.parquet")
    endo = rows | {"alert": [False] * len(rows["fips"]), "alerts_2wks": [3.0] * len(rows["fips"]),
                   "issued_in_advance": [0.5] * len(rows["fips"])}
    pq.write_table(pa.table(endo), root / "data" / "65k" / "endogenous_states_actions.parquet")
    (root / "w").mkdir()
    (root / "w" / "config.yaml").write_text(yaml.safe_dump({"fips_list": ["04013", "06037", "99999"]}))
    coefficients = {"baseline_bias": -3.0, "baseline_heat_qi": 1.0, "baseline_issued_in_advance": 0.2,
                    "effectiveness_bias": -1.0, "effectiveness_alert_lag1": -0.5, "effectiveness_alerts_2wks": -0.1,
                    "effectiveness_heat_qi_above_75": 2.0}
    save_file({k: (v + rng.normal(0, 0.1, (3, 1, 3))).astype(np.float32) for k, v in coefficients.items()},
              str(root / "w" / "posterior_samples.safetensors"))


def test_weather2alert_files_drive_the_reward_with_one_posterior_sample_per_episode(tmp_path):
    pytest.importorskip("pyarrow")
    write_weather2alert_files(tmp_path)
    lang = make_env("heatalerts", simulator="weather2alert", data_dir=str(tmp_path), weights="w", horizon=8)
    env = lang.env.unwrapped
    lang.reset(seed=1)
    assert env.summer.county in ("06037", "04013") and env.summer.days == 40
    assert set(env.summer.baseline) == {"bias", "heat_qi", "issued_in_advance"}
    from safetensors.numpy import load_file

    posterior = load_file(str(tmp_path / "w" / "posterior_samples.safetensors"))
    location = ["04013", "06037", "99999"].index(env.summer.county)
    matches = [s for s in range(3) if np.isclose(posterior["baseline_bias"][s, 0, location], env.summer.baseline["bias"])]
    assert len(matches) == 1  # one posterior sample, of this county
    sample = matches[0]
    assert env.summer.effectiveness["alerts_2wks"] == pytest.approx(float(posterior["effectiveness_alerts_2wks"][sample, 0, location]))
    for action in (1, 1, 0):
        expected = expected_reward(env, action)
        assert env.features()["issued_in_advance"] == 0.5  # a column of the endogenous file
        assert lang.step(action)[1] == pytest.approx(expected)
    # the reward sees the agent's own alerts in the last 14 days (2), not the data's historical alerts_2wks (3)
    assert env.features()["alerts_2wks"] == 2.0


def test_weather2alert_loader_names_what_is_missing(tmp_path):
    pytest.importorskip("pyarrow")
    with pytest.raises(ConfigError, match="lacks .*exogenous_states.parquet"):
        HeatAlertsEnv(simulator="weather2alert", data_dir=str(tmp_path))
    write_weather2alert_files(tmp_path)
    with pytest.raises(ConfigError, match=r"counties \['12345'\] are not in"):
        HeatAlertsEnv(simulator="weather2alert", data_dir=str(tmp_path), weights="w", counties=["12345"])
    from safetensors.numpy import load_file, save_file

    posterior = load_file(str(tmp_path / "w" / "posterior_samples.safetensors"))
    save_file(posterior | {"baseline_tree_cover": posterior["baseline_bias"]}, str(tmp_path / "w" / "posterior_samples.safetensors"))
    with pytest.raises(ConfigError, match=r"the features \['tree_cover'\]"):
        HeatAlertsEnv(simulator="weather2alert", data_dir=str(tmp_path), weights="w")


def test_template_config_fits_and_compares_every_fixed_rule(tmp_path, capsys):
    import torch

    from flowkit.cli import main
    from flowkit.rbrl.templates import LIBRARIES

    cache = tmp_path / "emb.pt"
    gen = torch.Generator().manual_seed(0)
    torch.save({f"{r.rule} {r.background}": torch.randn(8, generator=gen) for r in LIBRARIES["heatalerts"]}, cache)
    main(["fit", "--config", "configs/rbrl_heatalerts.yaml", "--trainer.default_root_dir", str(tmp_path / "run"),
          "--data.init_args.embedding_cache", str(cache), "--data.init_args.updates_per_epoch", "3",
          "--model.init_args.warmup_steps", "16", "--data.init_args.env_kwargs", '{"horizon": 6}',
          "--data.init_args.eval_seeds", "[1]", "--data.init_args.eval_episodes", "2"])
    out = capsys.readouterr().out
    assert "RBRL heatalerts: mean episode return" in out
    assert all(f"fixed: {rule.name}" in out for rule in LIBRARIES["heatalerts"])
