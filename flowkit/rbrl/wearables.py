"""Wearable-device assignment (seed 002 §7, App. D.1; after Boehmer et al. 2024), simulated here.

``num_patients`` postpartum patients; each step one monitoring device may be given to one patient,
at most ``budget`` times per episode. Vital signs v = (temperature °C, pulse bpm, respiratory rate
/min, SpO2 %) of patient i follow a mean-reverting random walk towards a patient-specific drift
target μ_i = healthy + severity_iv · (2.5, 55, 20, −14), one severity_iv ~ U(0, max_severity)
per patient and vital:

    v ← v + reversion · (μ_i − v) + noise ⊙ N(0, I)

A device lowers risk with probability ``device_success`` = 0.7: the patient's vitals first move
``device_effect`` of the way back to the healthy values (37.0, 80, 16, 98).

Reward (after the transition), per patient: each vital beyond its threshold (38 °C, 120 bpm, 30 /min
above; 90 % SpO2 below) costs exp(|excess| / scale) with scales (2, 17, 5, 4); the sum is scaled by
0.1 and clipped at −1; the step reward is the sum over patients. Assigning a device with no budget
left is invalid: it costs ``invalid_penalty`` and has no effect.
Actions: ``i < num_patients`` gives the device to patient i; ``num_patients`` keeps it unused.
"""

from __future__ import annotations

from typing import ClassVar

import gymnasium as gym
import numpy as np

from flowkit.rbrl.language import LanguageEnv

HEALTHY = np.array([37.0, 80.0, 16.0, 98.0])
THRESHOLDS = np.array([38.0, 120.0, 30.0, 90.0])
ABOVE = np.array([True, True, True, False])  # SpO2 is penalised below its threshold
PENALTY_SCALES = np.array([2.0, 17.0, 5.0, 4.0])
SEVERE_SHIFT = np.array([2.5, 55.0, 20.0, -14.0])
NOISE = np.array([0.15, 4.0, 1.5, 1.0])
VITAL_NAMES = ("temperature", "pulse", "respiratory rate", "SpO2")
VITAL_UNITS = ("°C", "bpm", "/min", "%")


def patient_penalty(vitals: np.ndarray) -> np.ndarray:
    """Per-patient risk penalty (≤ 0) for vitals of shape (..., 4)."""
    excess = np.where(ABOVE, vitals - THRESHOLDS, THRESHOLDS - vitals)
    terms = np.where(excess > 0, np.exp(np.abs(excess) / PENALTY_SCALES), 0.0)
    return np.maximum(-0.1 * terms.sum(-1), -1.0)


class WearablesEnv(gym.Env):
    metadata: ClassVar[dict] = {"render_modes": []}

    def __init__(
        self,
        num_patients: int = 5,
        horizon: int = 24,
        budget: int = 20,
        max_severity: float = 1.2,
        reversion: float = 0.15,
        device_success: float = 0.7,
        device_effect: float = 0.6,
        invalid_penalty: float = 1.0,
    ):
        self.num_patients = num_patients
        self.horizon = horizon
        self.budget = budget
        self.max_severity = max_severity
        self.reversion = reversion
        self.device_success = device_success
        self.device_effect = device_effect
        self.invalid_penalty = invalid_penalty
        self.action_space = gym.spaces.Discrete(num_patients + 1)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(num_patients * 4 + 2,), dtype=np.float32)
        self.vitals = np.tile(HEALTHY, (num_patients, 1))
        self.targets = self.vitals.copy()
        self.budget_left = budget
        self.t = 0

    def _observation(self) -> np.ndarray:
        extra = [self.budget_left, self.t / self.horizon]
        return np.concatenate([self.vitals.ravel(), extra]).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        severity = self.np_random.uniform(0.0, self.max_severity, size=(self.num_patients, 4))
        self.targets = HEALTHY + severity * SEVERE_SHIFT
        # start somewhere between healthy and the drift target
        start = self.np_random.uniform(0.0, 1.0, size=(self.num_patients, 1))
        self.vitals = HEALTHY + start * (self.targets - HEALTHY)
        self.budget_left = self.budget
        self.t = 0
        return self._observation(), {}

    def step(self, action: int):
        action = int(action)
        if not 0 <= action <= self.num_patients:
            raise ValueError(f"action {action} outside [0, {self.num_patients}]")
        assigns = action < self.num_patients
        invalid = assigns and self.budget_left <= 0
        if assigns and not invalid:
            self.budget_left -= 1
            if self.np_random.random() < self.device_success:
                self.vitals[action] += self.device_effect * (HEALTHY - self.vitals[action])
        noise = NOISE * self.np_random.standard_normal(self.vitals.shape)
        self.vitals = self.vitals + self.reversion * (self.targets - self.vitals) + noise
        reward = float(patient_penalty(self.vitals).sum()) - (self.invalid_penalty if invalid else 0.0)
        self.t += 1
        terminated = self.t >= self.horizon
        return self._observation(), reward, terminated, False, {"invalid": invalid}


class WearablesLanguage(LanguageEnv):
    task = (
        "You manage wearable monitoring devices for {n} postpartum patients. Each step you may give one "
        "device to one patient; a device succeeds with probability 0.7 and then moves that patient's vital "
        "signs (temperature, pulse, respiratory rate, SpO2) back towards healthy values. Risk penalties "
        "start above 38 °C, 120 bpm, 30 breaths/min and below 90 % SpO2 and grow exponentially. You have "
        "{budget} device uses per episode of {horizon} steps; you may also keep the device unused."
    )
    example_rules = (
        '{"background": "Penalties grow exponentially past the thresholds.", "rule": "Give the device to the patient '
        'whose vital signs are furthest beyond a threshold.", "state_relevance": "Compare each patient\'s worst vital."}',
        '{"background": "Device uses are limited, healthy patients gain nothing.", "rule": "When every patient is '
        'within the thresholds, keep the device unused.", "state_relevance": "Check whether anyone is at risk now."}',
    )

    def __init__(self, env: WearablesEnv | None = None, **env_kwargs):
        super().__init__(env or WearablesEnv(**env_kwargs))
        e = self.env.unwrapped
        self.task = type(self).task.format(n=e.num_patients, budget=e.budget, horizon=e.horizon)

    def risks(self) -> np.ndarray:
        """Current per-patient penalty (≤ 0): the quantity the reward charges next step."""
        return patient_penalty(self.env.unwrapped.vitals)

    def describe(self) -> str:
        env = self.env.unwrapped
        lines = []
        for i, v in enumerate(env.vitals):
            vitals = ", ".join(f"{n} {x:.1f} {u}" for n, x, u in zip(VITAL_NAMES, v, VITAL_UNITS))
            lines.append(f"patient {i}: {vitals}")
        return (
            f"Step {env.t + 1} of {env.horizon}, {env.budget_left} device uses left. " + "; ".join(lines) + "."
        )

    def valid_actions(self) -> dict[int, str]:
        env = self.env.unwrapped
        actions = {env.num_patients: "keep the device unused this step"}
        if env.budget_left > 0:
            actions.update({i: f"give the device to patient {i}" for i in range(env.num_patients)})
        return dict(sorted(actions.items()))

    def state_features(self) -> np.ndarray:
        env = self.env.unwrapped
        scaled = (env.vitals - THRESHOLDS) / PENALTY_SCALES
        extra = [env.budget_left / max(env.budget, 1), env.t / env.horizon]
        return np.concatenate([scaled.ravel(), extra]).astype(np.float32)
