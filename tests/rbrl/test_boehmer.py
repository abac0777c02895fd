"""Boehmer et al.'s wearables dynamics (flowkit.rbrl.boehmer) on synthetic parameter files in the official
``train_gmm.py`` layout, written by the tests: hand-computed transitions, rewards and bookkeeping."""

import math

import numpy as np
import pytest
import torch

from flowkit.errors import ConfigError
from flowkit.rbrl import boehmer
from flowkit.rbrl.agent import RuleAgent, random_chooser, run_episode
from flowkit.rbrl.boehmer import BoehmerVitalSignsEnv, Patient, load_parameters
from flowkit.rbrl.envs import make_env
from flowkit.rbrl.judges import ConsistencyJudge
from flowkit.rbrl.templates import TemplateRuleSource

NAMES = ["PULSE_RATE", "SPO2"]
SCALER_MIN, SCALER_MAX = np.array([0.0, 50.0]), np.array([200.0, 100.0])  # x = 0.7 → 140 bpm; x = 0.8 → 90 %
HEALTHY_X = np.array([0.4, 0.9])  # 80 bpm, 95 %


def _write(path, means, covariances, weights=(0.5, 0.5), names=NAMES, **override):
    arrays = dict(means=np.asarray(means), covariances=np.asarray(covariances), weights=np.asarray(weights),
                  scaler_min=SCALER_MIN, scaler_max=SCALER_MAX, names=np.array(names, dtype=str))
    arrays.update(override)
    np.savez(path, **arrays)
    return str(path)


def _joint(gain: float, a: float = 1e-4) -> np.ndarray:
    """Σ of (s_t, s_{t+1}) with s_{t+1} = μ₂ + gain·(s_t − μ₁) exactly (zero conditional covariance)."""
    eye = np.eye(2)
    return np.block([[a * eye, gain * a * eye], [gain * a * eye, gain**2 * a * eye]])


@pytest.fixture
def persistent(tmp_path):
    """States persist (s_{t+1} = s_t) and every arriving patient sits near the healthy state."""
    mean = np.concatenate([HEALTHY_X, HEALTHY_X])
    return _write(tmp_path / "persistent.npz", [mean, mean], [_joint(1.0), _joint(1.0)])


def _sick(worn: int, x=(0.7, 0.8)) -> Patient:
    state = np.array(x)
    mean = np.concatenate([HEALTHY_X, HEALTHY_X])
    return Patient(worn, np.tile(state[:, None], (1, 5)), mean, _joint(1.0))


SICK_RISK = -0.1 * math.exp(20 / 17)  # 140 bpm; SpO2 90 % is on its threshold, free


def test_conditional_step_and_patient_history_hand_computed(tmp_path):
    # s_{t+1} = μ₂ + 0.5 (s_t − μ₁), μ₁ = (0.5, 0.5), μ₂ = (0.6, 0.4)
    mean = np.array([0.5, 0.5, 0.6, 0.4])
    env = BoehmerVitalSignsEnv(_write(tmp_path / "p.npz", [mean, mean], [_joint(0.5), _joint(0.5)]), arm_noise=0.0)
    env.reset(seed=0)
    np.testing.assert_allclose(env.next_state(np.array([0.9, 0.1]), mean, _joint(0.5)), [0.8, 0.2], atol=1e-6)
    np.testing.assert_allclose(env.next_state(np.array([2.0, -2.0]), mean, _joint(0.5)), [1.0, 0.0], atol=1e-6)  # clipped
    # asymmetric coupling: Σ₁₁ = diag(0.04, 0.01), Σ₂₁ = [[0.02, 0.005], [0, 0]] → Σ₂₁Σ₁₁⁻¹ = [[0.5, 0.5], [0, 0]];
    # Σ₂₂ = Σ₂₁Σ₁₁⁻¹Σ₁₂ = diag(0.0125, 0): s = (0.9, 0.7) → (0.6 + 0.5·0.4 + 0.5·0.2, 0.4) = (0.9, 0.4)
    coupled = np.zeros((4, 4))
    coupled[:2, :2] = np.diag([0.04, 0.01])
    coupled[2:, :2] = [[0.02, 0.005], [0.0, 0.0]]
    coupled[:2, 2:] = coupled[2:, :2].T
    coupled[2, 2] = 0.0125
    np.testing.assert_allclose(env.next_state(np.array([0.9, 0.7]), mean, coupled), [0.9, 0.4], atol=1e-6)
    patient = env.new_patient()
    for t in range(1, 5):  # the window of 5 is filled by the chain from the first sample
        np.testing.assert_allclose(patient.history[:, t], [0.6, 0.4] + 0.5 * (patient.history[:, t - 1] - 0.5), atol=1e-6)
    np.testing.assert_allclose(patient.mean, mean)
    assert patient.worn == 0


def test_risk_denormalises_and_uses_the_official_penalties(persistent):
    p = load_parameters(persistent)
    assert p.risk(np.array([0.7, 0.8])) == pytest.approx(SICK_RISK)
    assert p.risk(np.array([0.7, 0.76])) == pytest.approx(-0.1 * (math.exp(20 / 17) + math.exp(2 / 4)))  # SpO2 88 %
    assert p.risk(HEALTHY_X) == 0.0
    assert p.risk(np.array([1.0, 0.0])) == -1.0  # clipped


def test_taking_a_worn_device_while_one_is_free_costs_the_penalty_and_her_remaining_steps(persistent):
    env = BoehmerVitalSignsEnv(persistent, budget=3, init_agents=1, system_duration=4, time_discount=0.5)
    env.reset(seed=0)
    env.devices = [_sick(worn=1), None, None]
    _, reward, terminated, truncated, info = env.step(0)
    # −1 (devices 1 and 2 were free) + her 4 − 1 = 3 unmonitored steps at SICK_RISK, discounted 1, 0.5, 0.25;
    # the arriving patient (near the healthy state, persistent) adds 0 after her first step with the device
    assert reward == pytest.approx(-1.0 + SICK_RISK * (1 + 0.5 + 0.25), abs=1e-6)
    assert info["took_worn_device"] and not terminated and not truncated
    assert env.devices[0].worn == 1 and env.devices[1] is None


def test_free_device_no_penalty_worn_patients_advance_and_leave_after_system_duration(persistent):
    env = BoehmerVitalSignsEnv(persistent, budget=3, init_agents=1, system_duration=4, intervention_success=0.0)
    env.reset(seed=0)
    env.devices = [_sick(worn=3), None, _sick(worn=1)]
    _, reward, _, _, info = env.step(1)
    assert reward == pytest.approx(2 * SICK_RISK, abs=1e-6) and not info["took_worn_device"]
    assert env.devices[0] is None  # worn 4 = system_duration steps: she left, the device is free
    assert env.devices[2].worn == 2 and env.devices[1].worn == 1
    obs = env._observation()
    np.testing.assert_allclose(obs[2], np.concatenate([[2 / 4], np.repeat([0.7, 0.8], 5), [0.7, 0.8], [0.0, 0.0]]), atol=1e-6)
    assert not obs[0].any()


def test_device_moves_abnormal_vitals_back(persistent, monkeypatch):
    monkeypatch.setitem(boehmer.IMPROVEMENT, "PULSE_RATE", (-15.0, 0.0))  # δ exactly 15 bpm
    env = BoehmerVitalSignsEnv(persistent, budget=2, init_agents=1, intervention_success=1.0)
    env.reset(seed=0)
    np.testing.assert_allclose(env.improved(np.array([0.7, 0.8])), [0.625, 0.8])  # 140 → 125 bpm; SpO2 not beyond
    np.testing.assert_allclose(env.improved(HEALTHY_X), HEALTHY_X)  # no risk: unchanged
    env.devices = [_sick(worn=1), None]
    _, reward, _, _, _ = env.step(1)
    assert reward == pytest.approx(-0.1 * math.exp(5 / 17), abs=1e-6)  # 125 bpm after the device
    never = BoehmerVitalSignsEnv(persistent, budget=2, init_agents=1, intervention_success=0.0)
    never.reset(seed=0)
    np.testing.assert_allclose(never.improved(np.array([0.7, 0.8])), [0.7, 0.8])


def test_reset_assigns_init_agents_and_episode_is_cut_at_horizon(persistent):
    env = BoehmerVitalSignsEnv(persistent, budget=5, init_agents=4, horizon=3)
    obs, _ = env.reset(seed=1)
    assert obs.shape == (5, 1 + 7 * 2) and sum(p is not None for p in env.devices) == 4
    assert all(p.worn == 1 for p in env.devices if p is not None)
    truncated = [env.step(0)[3] for _ in range(3)]
    assert truncated == [False, False, True]
    with pytest.raises(ValueError):
        env.step(5)


def test_parameter_file_layout_is_checked(tmp_path):
    mean = np.zeros(4)
    good = dict(means=[mean, mean], covariances=[_joint(1.0), _joint(1.0)])
    with pytest.raises(ConfigError, match="no file"):
        load_parameters(tmp_path / "absent.npz")
    with pytest.raises(ConfigError, match=r"means must have shape \(2, 4\)"):
        load_parameters(_write(tmp_path / "a.npz", [np.zeros(3)] * 2, good["covariances"]))
    with pytest.raises(ConfigError, match="names must be distinct"):
        load_parameters(_write(tmp_path / "b.npz", **good, names=["PULSE_RATE", "HEART"]))
    with pytest.raises(ConfigError, match="lacks the arrays"):
        np.savez(tmp_path / "c.npz", means=np.zeros((2, 4)))
        load_parameters(tmp_path / "c.npz")
    with pytest.raises(ConfigError, match="budget must be >= 1"):
        BoehmerVitalSignsEnv(_write(tmp_path / "d.npz", **good), budget=0)
    with pytest.raises(ConfigError, match="wearables env_kwargs.simulator must be one of"):
        make_env("wearables", simulator="mimic")


def test_language_env_and_template_rules_run_episodes(tmp_path):
    rng = np.random.default_rng(0)
    means, covs = [], []
    for _ in range(3):  # a random full-rank mixture, as a fitted file would be
        m = rng.uniform(0.3, 0.9, size=4)
        root = rng.normal(size=(4, 4)) * 0.05
        means.append(m)
        covs.append(root @ root.T + 1e-3 * np.eye(4))
    path = _write(tmp_path / "fitted.npz", means, covs, weights=(0.2, 0.3, 0.5))
    env = make_env("wearables", simulator="boehmer", parameters=path)
    env.reset(seed=3)
    assert list(env.valid_actions()) == [0, 1, 2, 3, 4]
    assert "1 of 5 devices free" in env.describe() and "pulse rate" in env.describe()
    assert env.state_features().shape == (5 * 15,)
    source = TemplateRuleSource("boehmer", seed=0)
    agent = RuleAgent(env, source, ConsistencyJudge(), embeddings=lambda texts: torch.zeros(len(texts), 4), max_rules=10)
    total, records = run_episode(agent, random_chooser(0), 7)
    assert len(records) == 32 and math.isfinite(total) and total < 0
    free = [i for i, p in enumerate(env.unwrapped.devices) if p is None]
    rule = next(r for r in source.generate(env) if r.name == "free_else_lowest_risk")
    assert rule.preferred[0] == (free[0] if free else int(np.argmax(env.risks())))


def test_boehmer_template_rules_hand_checked(persistent):
    env = make_env("wearables", simulator="boehmer", parameters=persistent, budget=3, init_agents=1)
    env.reset(seed=0)
    calm = _sick(worn=2, x=HEALTHY_X)
    calm.history[:, 0] = [0.3, 0.9]  # volatile pulse history, healthy now
    env.unwrapped.devices = [_sick(worn=1), calm, _sick(worn=5, x=(0.75, 0.8))]
    source = TemplateRuleSource("boehmer")
    rules = {r.name: r.preferred for r in source.generate(env)}
    assert rules == {"free_else_lowest_risk": (1,), "free_else_longest_worn": (2,), "free_else_most_stable": (0,),
                     "free_else_first": (0,), "highest_risk": (2,), "always_first": (0,)}
    env.unwrapped.devices[2] = None
    rules = {r.name: r.preferred for r in source.generate(env)}
    assert rules["free_else_lowest_risk"] == rules["free_else_longest_worn"] == rules["free_else_first"] == (2,)
    assert rules["highest_risk"] == (0,) and rules["always_first"] == (0,)
