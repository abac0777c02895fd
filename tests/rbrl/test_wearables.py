import math

import numpy as np
import pytest

from flowkit.rbrl import wearables
from flowkit.rbrl.wearables import HEALTHY, WearablesEnv, WearablesLanguage, patient_penalty


def test_penalty_hand_checked():
    # excess 1 °C, 17 bpm, 5 /min, 4 % → exp(1/2) + 3·e, scaled by 0.1
    vitals = np.array([39.0, 137.0, 35.0, 86.0])
    expected = -0.1 * (math.exp(0.5) + 3 * math.e)
    assert patient_penalty(vitals) == pytest.approx(expected)
    assert patient_penalty(np.array([38.0, 120.0, 30.0, 90.0])) == 0.0  # thresholds themselves are free
    assert patient_penalty(HEALTHY) == 0.0
    assert patient_penalty(np.array([42.0, 180.0, 50.0, 70.0])) == -1.0  # clipped


@pytest.fixture
def quiet_env(monkeypatch):
    """No noise, no drift: transitions are exact."""
    monkeypatch.setattr(wearables, "NOISE", np.zeros(4))
    env = WearablesEnv(num_patients=2, horizon=3, budget=1, reversion=0.0, device_success=1.0, device_effect=0.5)
    env.reset(seed=0)
    env.vitals = np.array([[39.0, 137.0, 35.0, 86.0], [37.0, 80.0, 16.0, 98.0]])
    return env


def test_device_moves_vitals_towards_healthy_and_spends_budget(quiet_env):
    env = quiet_env
    _, reward, terminated, _, info = env.step(0)
    np.testing.assert_allclose(env.vitals[0], [38.0, 108.5, 25.5, 92.0])
    assert reward == pytest.approx(0.0) and env.budget_left == 0 and not info["invalid"] and not terminated


def test_assigning_without_budget_is_invalid(quiet_env):
    env = quiet_env
    env.step(1)  # spends the only device use on the healthy patient
    _, reward, _, _, info = env.step(0)
    assert info["invalid"]
    np.testing.assert_allclose(env.vitals[0], [39.0, 137.0, 35.0, 86.0])  # no effect
    assert reward == pytest.approx(patient_penalty(env.vitals[0]) - 1.0)


def test_holding_keeps_budget_and_episode_ends_at_horizon(quiet_env):
    env = quiet_env
    for t in range(3):
        _, reward, terminated, _, _ = env.step(2)
        assert reward == pytest.approx(patient_penalty(np.array([39.0, 137.0, 35.0, 86.0])))
    assert terminated and env.budget_left == 1
    with pytest.raises(ValueError):
        env.step(3)


def test_device_succeeds_with_probability_0_7(monkeypatch):
    monkeypatch.setattr(wearables, "NOISE", np.zeros(4))
    env = WearablesEnv(num_patients=1, horizon=10**6, budget=10**6, reversion=0.0)
    env.reset(seed=0)
    sick = np.array([[39.0, 137.0, 35.0, 86.0]])
    successes = 0
    for _ in range(2000):
        env.vitals = sick.copy()
        env.step(0)
        successes += not np.allclose(env.vitals, sick)
    assert abs(successes / 2000 - 0.7) < 0.04


def test_language_wrapper():
    env = WearablesLanguage()
    env.reset(seed=0)
    assert len(env.valid_actions()) == 6 and "keep the device unused" in env.valid_actions()[5]
    env.unwrapped.budget_left = 0
    assert list(env.valid_actions()) == [5]
    assert "patient 4" in env.describe() and "0 device uses left" in env.describe()
    assert env.state_features().shape == (22,)
