"""Wearable-device assignment with Boehmer et al. (2024)'s vital-sign dynamics, as the official RBRL code
runs them (seed 002 §7 "WearableDeviceAssignment", environments Uganda / MimicIII), from a parameter file
the user supplies. The official repository ships its fitted files (``models/uganda.npz``,
``models/mimic-iii.npz``) without a licence, so flowkit cannot bundle them.

Parameter file (``np.savez`` layout of the official ``train_gmm.py``), d vital signs, K components:
``names`` (d,) from PULSE_RATE, RESPIRATORY_RATE, SPO2, COVERED_SKIN_TEMPERATURE; ``scaler_min`` /
``scaler_max`` (d,): the min-max normalisation, x = (v − min) / (max − min); ``weights`` (K,), ``means``
(K, 2d), ``covariances`` (K, 2d, 2d): a Gaussian mixture over consecutive normalised states (s_t, s_{t+1}).

Dynamics (``budget`` devices; each step a new patient arrives and the action is the device she gets):
- A patient: component k ~ weights; s_0 ~ N(μ_k, Σ_k) restricted to its first d coordinates, then
  ``variability_window`` − 1 steps of s_{t+1} | s_t ~ N(μ₂ + Σ₂₁Σ₁₁⁻¹(s_t − μ₁), Σ₂₂ − Σ₂₁Σ₁₁⁻¹Σ₁₂)
  (every sample clipped to [0, 1]) fill her history; her own dynamics then use (μ, Σ) moved towards another
  component j ≠ k (uniform): μ = (1 − x)μ_k + xμ_j, Σ = (1 − y)Σ_k + yΣ_j with x, y ~ U(0, ``arm_noise``).
- Risk of a state: the denormalised vitals' penalties — −exp(|v − 38|/2) above 38 °C, −exp(|v − 120|/17)
  above 120 bpm, −exp(|v − 30|/5) above 30 /min, −exp(|v − 90|/4) below 90 % SpO2 — summed, × 0.1,
  clipped at −1 (:func:`flowkit.rbrl.wearables.patient_penalty`).
- Wearing a device: if her current risk is < 0, with probability ``intervention_success`` each vital beyond
  its threshold moves back by δ (°C ~ N(1.5, 0.5), bpm ~ N(15, 5), /min ~ N(10, 10/3), SpO2 % ~ N(5, 5/3));
  the next state is then sampled conditionally on the (improved) state.
- A step with action i: (1) if device i is worn while another device is free, −``ignore_free_penalty``;
  (2) a patient who loses device i plays her remaining ``system_duration`` − worn steps without a device,
  adding Σ_t γ^t r_t (γ = ``time_discount``); (3) the new patient gets device i; (4) every worn device's
  patient (the new one included) advances one step with the device, adding her risk r; a patient who has
  worn a device ``system_duration`` steps leaves and frees it. The episode is cut after ``horizon`` steps
  (``truncated``, as the official ``TimeLimit(max_episode_steps=32)``).
- Every device may be given, so every action is valid (``info["invalid"]`` is always False).
- Reset: ``init_agents`` of the devices, chosen at random, are worn by fresh patients (worn 1 step).
- Observation per device: [worn steps / ``system_duration``, history (d × window), its mean (d), its
  std (d)], zeros for a free device.
Defaults are the official ``VitalSignsSimple``'s with the paper's ``time_discount`` 0.95.

Two bookkeeping details of the official code are deliberately not reproduced: when a worn device is taken,
its ``step`` simulates the leaving patient's remaining steps conditioned on the *new* patient's vitals from
the second step on (writing them into the new patient's history), and the new patient keeps the leaving
patient's mixture component. Here the leaving patient follows her own state and component, and the new
patient keeps hers. The official initial assignment also draws from numpy's global generator; here every
draw comes from the environment's seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import gymnasium as gym
import numpy as np

from flowkit.errors import ConfigError
from flowkit.rbrl.language import LanguageEnv
from flowkit.rbrl.wearables import ABOVE, HEALTHY, THRESHOLDS, patient_penalty

# the official vital names → index into flowkit.rbrl.wearables' (temperature, pulse, respiratory rate, SpO2)
VITAL_INDEX = {"COVERED_SKIN_TEMPERATURE": 0, "PULSE_RATE": 1, "RESPIRATORY_RATE": 2, "SPO2": 3}
VITAL_TEXT = {"COVERED_SKIN_TEMPERATURE": ("covered skin temperature", "°C"), "PULSE_RATE": ("pulse rate", "bpm"),
              "RESPIRATORY_RATE": ("respiratory rate", "/min"), "SPO2": ("SpO2", "%")}
# δ ~ N(mean, std) by which a successful intervention moves an abnormal vital back (SpO2 up, the others down)
IMPROVEMENT = {"COVERED_SKIN_TEMPERATURE": (-1.5, 0.5), "PULSE_RATE": (-15.0, 5.0),
               "RESPIRATORY_RATE": (-10.0, 10.0 / 3), "SPO2": (5.0, 5.0 / 3)}


@dataclass(frozen=True)
class BoehmerParameters:
    names: tuple[str, ...]
    scaler_min: np.ndarray  # (d,)
    scaler_max: np.ndarray  # (d,)
    weights: np.ndarray  # (K,), normalised to sum 1
    means: np.ndarray  # (K, 2d)
    covariances: np.ndarray  # (K, 2d, 2d)

    @property
    def num_vitals(self) -> int:
        return len(self.names)

    def denormalise(self, x: np.ndarray) -> np.ndarray:
        return x * (self.scaler_max - self.scaler_min) + self.scaler_min

    def normalise(self, v: np.ndarray) -> np.ndarray:
        return (v - self.scaler_min) / (self.scaler_max - self.scaler_min)

    def risk(self, x: np.ndarray) -> float:
        """Risk penalty (≤ 0) of one normalised state; vitals the file does not model count as healthy."""
        vitals = HEALTHY.copy()
        vitals[[VITAL_INDEX[n] for n in self.names]] = self.denormalise(x)
        return float(patient_penalty(vitals))


def load_parameters(path: str | Path) -> BoehmerParameters:
    """Read and check a parameter file in the official ``train_gmm.py`` layout (module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"wearables parameters: no file {str(path)!r} (a Boehmer et al. GMM file, e.g. the official models/uganda.npz)")
    with np.load(path, allow_pickle=False) as data:
        missing = {"names", "scaler_min", "scaler_max", "weights", "means", "covariances"} - set(data.files)
        if missing:
            raise ConfigError(f"wearables parameters {str(path)!r} lacks the arrays {sorted(missing)}")
        names = tuple(str(n) for n in data["names"])
        p = BoehmerParameters(names, *(np.asarray(data[k], dtype=np.float64) for k in
                                       ("scaler_min", "scaler_max", "weights", "means", "covariances")))
    unknown = [n for n in names if n not in VITAL_INDEX]
    if unknown or len(set(names)) != len(names):
        raise ConfigError(f"wearables parameters: names must be distinct, from {sorted(VITAL_INDEX)}, got {list(names)}")
    d, k = len(names), len(p.weights)
    shapes = {"scaler_min": (d,), "scaler_max": (d,), "weights": (k,), "means": (k, 2 * d), "covariances": (k, 2 * d, 2 * d)}
    for key, shape in shapes.items():
        if getattr(p, key).shape != shape:
            raise ConfigError(f"wearables parameters: {key} must have shape {shape} for {d} vitals and {k} components, "
                              f"got {getattr(p, key).shape}")
    if k < 2 or (p.weights < 0).any() or p.weights.sum() <= 0:
        raise ConfigError(f"wearables parameters: need >= 2 components with non-negative weights, got {p.weights.tolist()}")
    if not (p.scaler_max > p.scaler_min).all():
        raise ConfigError("wearables parameters: scaler_max must exceed scaler_min for every vital")
    return BoehmerParameters(names, p.scaler_min, p.scaler_max, p.weights / p.weights.sum(), p.means, p.covariances)


@dataclass
class Patient:
    worn: int  # steps she has worn her device
    history: np.ndarray  # (d, window) normalised states, oldest first; the last column is the current state
    mean: np.ndarray  # (2d,) her perturbed mixture component
    cov: np.ndarray  # (2d, 2d)

    @property
    def state(self) -> np.ndarray:
        return self.history[:, -1]


class BoehmerVitalSignsEnv(gym.Env):
    metadata: ClassVar[dict] = {"render_modes": []}

    def __init__(
        self,
        parameters: str,
        budget: int = 5,
        init_agents: int = 4,
        system_duration: int = 10,
        arm_noise: float = 0.15,
        intervention_success: float = 0.7,
        variability_window: int = 5,
        time_discount: float = 0.95,
        ignore_free_penalty: float = 1.0,
        horizon: int = 32,
    ):
        checks = [
            (budget >= 1, f"budget must be >= 1, got {budget}"),
            (0 <= init_agents <= budget, f"init_agents must be in [0, budget={budget}], got {init_agents}"),
            (system_duration >= 1, f"system_duration must be >= 1, got {system_duration}"),
            (0.0 <= arm_noise <= 1.0, f"arm_noise must be in [0, 1], got {arm_noise}"),
            (0.0 <= intervention_success <= 1.0, f"intervention_success must be in [0, 1], got {intervention_success}"),
            (variability_window >= 1, f"variability_window must be >= 1, got {variability_window}"),
            (0.0 <= time_discount <= 1.0, f"time_discount must be in [0, 1], got {time_discount}"),
            (horizon >= 1, f"horizon must be >= 1, got {horizon}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"wearables (simulator: boehmer) {message}")
        self.params = load_parameters(parameters)
        self.budget, self.init_agents, self.system_duration = budget, init_agents, system_duration
        self.arm_noise, self.intervention_success, self.window = arm_noise, intervention_success, variability_window
        self.time_discount, self.ignore_free_penalty, self.horizon = time_discount, ignore_free_penalty, horizon
        d = self.params.num_vitals
        self.per_device_dim = 1 + (variability_window + 2) * d
        self.action_space = gym.spaces.Discrete(budget)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(budget, self.per_device_dim), dtype=np.float32)
        self.devices: list[Patient | None] = [None] * budget
        self.t = 0

    # ---- the patient model ----

    def next_state(self, state: np.ndarray, mean: np.ndarray, cov: np.ndarray) -> np.ndarray:
        """s_{t+1} | s_t under the joint Gaussian (μ, Σ) of (s_t, s_{t+1}), clipped to [0, 1]."""
        d = self.params.num_vitals
        gain = np.linalg.solve(cov[:d, :d], cov[:d, d:]).T  # Σ₂₁ Σ₁₁⁻¹ (Σ symmetric)
        cond_mean = mean[d:] + gain @ (state - mean[:d])
        cond_cov = cov[d:, d:] - gain @ cov[:d, d:]
        return np.clip(self.np_random.multivariate_normal(cond_mean, cond_cov), 0.0, 1.0)

    def new_patient(self) -> Patient:
        p = self.params
        k = int(self.np_random.choice(len(p.weights), p=p.weights))
        mean, cov = p.means[k], p.covariances[k]
        d = p.num_vitals
        history = np.zeros((d, self.window))
        history[:, 0] = np.clip(self.np_random.multivariate_normal(mean, cov)[:d], 0.0, 1.0)
        for t in range(1, self.window):
            history[:, t] = self.next_state(history[:, t - 1], mean, cov)
        other = int(self.np_random.choice([j for j in range(len(p.weights)) if j != k]))
        x, y = self.np_random.uniform(0.0, self.arm_noise, size=2)
        return Patient(0, history, (1 - x) * mean + x * p.means[other], (1 - y) * cov + y * p.covariances[other])

    def improved(self, state: np.ndarray) -> np.ndarray:
        """A device's effect on a state at risk: with probability ``intervention_success`` every vital
        beyond its threshold moves back by a random δ (in physical units)."""
        p = self.params
        if p.risk(state) >= 0 or self.np_random.random() >= self.intervention_success:
            return state
        vitals = p.denormalise(state)
        index = [VITAL_INDEX[n] for n in p.names]
        beyond = np.where(ABOVE[index], vitals > THRESHOLDS[index], vitals < THRESHOLDS[index])
        for i in np.flatnonzero(beyond):
            vitals[i] += self.np_random.normal(*IMPROVEMENT[p.names[i]])
        return p.normalise(vitals)

    def advance(self, patient: Patient, device: bool) -> float:
        """One step of her vitals (with or without the device); returns the new state's risk."""
        start = self.improved(patient.state) if device else patient.state
        nxt = self.next_state(start, patient.mean, patient.cov)
        patient.history = np.concatenate([patient.history[:, 1:], nxt[:, None]], axis=1)
        return self.params.risk(nxt)

    # ---- gymnasium ----

    def _observation(self) -> np.ndarray:
        obs = np.zeros((self.budget, self.per_device_dim), dtype=np.float32)
        for i, patient in enumerate(self.devices):
            if patient is not None:
                h = patient.history
                obs[i] = np.concatenate([[patient.worn / self.system_duration], h.ravel(), h.mean(1), h.std(1)])
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        self.devices = [None] * self.budget
        for i in self.np_random.choice(self.budget, self.init_agents, replace=False):
            patient = self.new_patient()
            patient.worn = 1
            self.devices[int(i)] = patient
        return self._observation(), {}

    def step(self, action: int):
        action = int(action)
        if not 0 <= action < self.budget:
            raise ValueError(f"action {action} outside [0, {self.budget - 1}]")
        self.t += 1
        arriving = self.new_patient()
        reward = 0.0
        leaving = self.devices[action]
        took_worn_device = leaving is not None
        if took_worn_device:
            if any(p is None for p in self.devices):
                reward -= self.ignore_free_penalty
            for t in range(self.system_duration - leaving.worn):
                reward += self.time_discount**t * self.advance(leaving, device=False)
        self.devices[action] = arriving
        for i, patient in enumerate(self.devices):
            if patient is None:
                continue
            patient.worn += 1
            reward += self.advance(patient, device=True)
            if patient.worn >= self.system_duration:
                self.devices[i] = None
        truncated = self.t >= self.horizon
        return self._observation(), float(reward), False, truncated, {"invalid": False, "took_worn_device": took_worn_device}


class BoehmerLanguage(LanguageEnv):
    task = (
        "You are assisting doctors of a hospital in deciding which of {budget} monitoring devices to give to an "
        "incoming postpartum patient; every incoming patient must receive a device. A device taken from its "
        "current patient leaves her unmonitored for the rest of her {duration} steps in the system. A cost is "
        "incurred when the pulse rate exceeds 120 bpm, the temperature 38 °C, the respiratory rate 30 /min, or "
        "SpO2 falls below 90 %; it grows exponentially with the deviation. A device moves a patient's abnormal "
        "vital signs back towards normal with an estimated 70 % success rate. Taking a worn device while "
        "another is free costs an extra penalty."
    )
    example_rules = (  # the official VitalSignsSimpleLang's first two examples' ideas, in flowkit's rule format
        '{"background": "Free devices are unused resources; taking a free device leaves every patient monitored.", '
        '"rule": "Give the new patient a free device if there is one.", "state_relevance": "Check the free devices."}',
        '{"background": "A patient with normal, stable vital signs loses least when her device is taken.", '
        '"rule": "If no device is free, take the device of the patient with normal and least volatile vital signs.", '
        '"state_relevance": "Compare the patients\' last values and standard deviations."}',
    )

    def __init__(self, parameters: str, **env_kwargs):
        super().__init__(BoehmerVitalSignsEnv(parameters, **env_kwargs))
        e = self.env.unwrapped
        self.task = type(self).task.format(budget=e.budget, duration=e.system_duration)

    def risks(self) -> np.ndarray:
        """Current risk penalty (≤ 0) of each device's patient; 0 for a free device."""
        e = self.env.unwrapped
        return np.array([0.0 if p is None else e.params.risk(p.state) for p in e.devices])

    def describe(self) -> str:
        e = self.env.unwrapped
        free = [i for i, p in enumerate(e.devices) if p is None]
        parts = [f"Step {e.t + 1} of {e.horizon}. {len(free)} of {e.budget} devices free"
                 + (f" (devices {', '.join(map(str, free))})." if free else ".")]
        for i, patient in enumerate(e.devices):
            if patient is None:
                continue
            history = e.params.denormalise(patient.history.T).T  # (d, window) physical units
            vitals = ", ".join(
                f"{VITAL_TEXT[n][0]} {h[-1]:.1f} {VITAL_TEXT[n][1]} (mean {h.mean():.1f}, std {h.std():.1f})"
                for n, h in zip(e.params.names, history))
            parts.append(f"Device {i}: worn {patient.worn} of {e.system_duration} steps; {vitals}.")
        return " ".join(parts)

    def valid_actions(self) -> dict[int, str]:
        e = self.env.unwrapped
        return {i: f"give device {i} to the new patient" + (" (it is free)" if p is None else
                                                            f" (taking it from a patient who wore it {p.worn} steps)")
                for i, p in enumerate(e.devices)}

    def state_features(self) -> np.ndarray:
        return self.env.unwrapped._observation().ravel()
