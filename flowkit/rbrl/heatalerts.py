"""HeatAlerts (seed 002 §7; Considine et al. 2025, the ``weather2alert`` environment): on which summer days to
issue a public heat alert, with a budget of alerts.

The official RBRL runs weather2alert's ``HeatAlertEnv`` with a budget of 10 alerts, random start days and episodes
cut at 32 days (its ``TimeLimit``). Each day the agent issues an alert (action 1) or not (0). The day's reward is
weather2alert's (``HeatAlertEnv._get_reward``, Medicare hospitalisations per 1000 per day of the 152-day summer):

    r = −(1000 / 152) · b · (1 − e · a),   b = σ(β · x),   e = σ(γ · x) · [heat_qi > 0.5]

with x the day's features and a bias: b the baseline rate of heat-related hospitalisations, e the share an alert
prevents (alerts only help on days hotter than the county's median). An alert with no budget left is not issued
and costs −``penalty`` (weather2alert: −1; the official RBRL config passes ``penalty=1.0``).

Features, as weather2alert computes them from the county's daily maximum heat index HI (°F): ``hi_max`` = HI / 100,
``heat_qi`` its percentile in the county's climate, ``heat_qi_3d`` / ``heat_qi_7d`` its means over the last 3 / 7
days (today included), ``excess_heat_3d`` / ``_7d`` = max(heat_qi − that mean, 0), ``heat_qi_above_75`` =
heat_qi · [heat_qi > 0.75], ``weekend``, ``holiday`` (US federal), ``dos`` (day of summer, 0 = May 1), and the
alert history the agent made: ``alert_lag1``, ``alerts_2wks`` (alerts in the last 14 days), ``alert_streak``,
``remaining_budget``.

Where the model comes from (``simulator``):

- ``synthetic`` (default): the county data and the fitted reward model (~100 MB on the Hugging Face Hub, fetched at
  run time by weather2alert) cannot be bundled, so flowkit ships a stand-in of the same form: 10 synthetic counties
  (as the official ``top_k_fips=10``), each with its own climate — HI(d) = peak − amplitude · ((d − 76)/76)² plus
  AR(1) anomalies (persistence ρ, std σ), so heatwaves last several days — and summers of 2006–2016 (real
  weekdays and holidays); heat_qi is HI's exact percentile under that climate. The coefficients β, γ are
  hand-set (:data:`SYNTHETIC_BASELINE`, :data:`SYNTHETIC_EFFECTIVENESS`) with the signs weather2alert's fitted model
  is constrained to: hospitalisations rise with heat; an alert helps more on hot and unexpected days (excess heat)
  and early in the summer, and less after recent alerts (alert fatigue). Per county the biases move by N(0, 0.3²),
  per episode every coefficient by N(0, 0.1²) (as weather2alert draws one posterior sample per episode). It is a
  stand-in with the paper's state, budget and reward structure, not the paper's numbers.
- ``weather2alert``: the real data and fitted model, read from ``data_dir``, a directory holding the files
  weather2alert downloads, in their Hugging Face layout: ``data/<split>/exogenous_states.parquet`` and
  ``endogenous_states_actions.parquet`` (dataset ``mauriciogtec/HeatAlertsRL-Data``) and
  ``<weights>/posterior_samples.safetensors`` and ``<weights>/config.yaml`` (model ``mauriciogtec/HeatAlertsRL-Models``,
  default ``nn_full_medicare_all``). The reward uses the posterior coefficients ``baseline_<feature>`` /
  ``effectiveness_<feature>`` (shape samples × 1 × counties), one posterior sample per episode, as weather2alert's
  ``_get_reward``; ``counties`` restricts the counties (default: every county of the config's ``fips_list`` with
  data). One deliberate difference: weather2alert overwrites ``alert_2wks`` (sic) with the agent's alerts, so its
  reward reads the data's *historical* ``alerts_2wks``; here the reward sees the agent's own alerts of the last 14
  days. The official RBRL also passes ``effectiveness_type="synthetic", reward_type="saved", random_starts=True,
  top_k_fips=10, min_heat_qi=0.0``, which no public weather2alert commit accepts, so their meaning is unknown and not
  reproduced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import ClassVar

import gymnasium as gym
import numpy as np
import torch

from flowkit.errors import ConfigError
from flowkit.rbrl.language import LanguageEnv

SUMMER_DAYS = 153  # May 1 – September 30, weather2alert's "dos" 0..152
REWARD_SCALE = 1000.0 / 152.0  # weather2alert's per-1000-per-day normalisation
YEARS = tuple(range(2006, 2017))  # weather2alert's valid years
# the features the synthetic reward reads (weather2alert's names), each coefficient hand-set (module docstring)
SYNTHETIC_BASELINE = {"bias": -4.6, "heat_qi_above_75": 1.2, "excess_heat_7d": 1.5, "weekend": -0.1, "holiday": -0.1}
SYNTHETIC_EFFECTIVENESS = {"bias": -1.5, "heat_qi_above_75": 1.5, "excess_heat_3d": 4.0, "early_summer": 0.8,
                           "alert_lag1": -1.0, "alerts_2wks": -0.25}
SYNTHETIC_COUNTIES = 10
FORECAST_DAYS = 7  # the language description's heat forecast, error std 0.5 °F per day ahead
ENDOGENOUS = ("alert_lag1", "alerts_2wks", "alert_streak", "remaining_budget")


def us_holidays(year: int) -> set[date]:
    """The US federal holidays of a summer: Memorial Day, Juneteenth (from 2021), Independence Day, Labor Day."""
    memorial = max(date(year, 5, d) for d in range(25, 32) if date(year, 5, d).weekday() == 0)
    labor = min(date(year, 9, d) for d in range(1, 8) if date(year, 9, d).weekday() == 0)
    return {memorial, date(year, 7, 4), labor} | ({date(year, 6, 19)} if year >= 2021 else set())


def _rolling_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Mean over the last ``window`` values, today included (fewer at the start), as pandas' rolling(min_periods=1)."""
    cumulative = np.concatenate([[0.0], np.cumsum(x)])
    end = np.arange(1, len(x) + 1)
    start = np.maximum(end - window, 0)
    return (cumulative[end] - cumulative[start]) / (end - start)


def heat_features(hi_max: np.ndarray, heat_qi: np.ndarray) -> dict[str, np.ndarray]:
    """The derived heat features of one county-summer from its daily hi_max (°F / 100) and heat_qi."""
    qi3, qi7 = _rolling_mean(heat_qi, 3), _rolling_mean(heat_qi, 7)
    return {
        "hi_max": hi_max, "heat_qi": heat_qi, "heat_qi_3d": qi3, "heat_qi_7d": qi7,
        "excess_heat_3d": np.maximum(heat_qi - qi3, 0.0), "excess_heat_7d": np.maximum(heat_qi - qi7, 0.0),
        "heat_qi_above_25": heat_qi * (heat_qi > 0.25), "heat_qi_above_75": heat_qi * (heat_qi > 0.75),
    }


def calendar_features(year: int, days: int = SUMMER_DAYS) -> dict[str, np.ndarray]:
    dates = [date(year, 5, 1) + timedelta(d) for d in range(days)]
    holidays = us_holidays(year)
    return {
        "dos": np.arange(days, dtype=np.float64),
        "weekend": np.array([d.weekday() >= 5 for d in dates], dtype=np.float64),
        "holiday": np.array([d in holidays for d in dates], dtype=np.float64),
        "early_summer": np.maximum(1.0 - np.arange(days) / 76.0, 0.0),
    }


@dataclass
class Summer:
    """One county-summer: its daily features (name → array over the days) and its reward coefficients."""

    county: str
    year: int
    features: dict[str, np.ndarray]
    baseline: dict[str, float]
    effectiveness: dict[str, float]

    @property
    def days(self) -> int:
        return len(self.features["heat_qi"])


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    return torch.special.ndtr(torch.from_numpy(x)).numpy()


class SyntheticCounties:
    """The stand-in model: :data:`SYNTHETIC_COUNTIES` counties, fixed for every run (their own seed)."""

    def __init__(self, seed: int = 2025):
        rng = np.random.default_rng(seed)
        self.counties = [f"synthetic-{i:02d}" for i in range(SYNTHETIC_COUNTIES)]
        self.peak = rng.uniform(88.0, 104.0, SYNTHETIC_COUNTIES)  # °F at mid-summer
        self.amplitude = rng.uniform(10.0, 20.0, SYNTHETIC_COUNTIES)  # °F cooler at the summer's ends
        self.sigma = rng.uniform(4.0, 7.0, SYNTHETIC_COUNTIES)  # °F std of the anomalies
        self.rho = rng.uniform(0.6, 0.85, SYNTHETIC_COUNTIES)  # day-to-day persistence of the anomalies
        self.bias_shift = rng.normal(0.0, 0.3, (SYNTHETIC_COUNTIES, 2))  # baseline, effectiveness bias per county
        days = np.arange(SUMMER_DAYS)
        self.seasonal = self.peak[:, None] - self.amplitude[:, None] * ((days - 76.0) / 76.0) ** 2

    def percentile(self, county: int, hi: np.ndarray) -> np.ndarray:
        """heat_qi: HI's percentile in the county's climate, the summer's mixture of N(seasonal(d), σ²)."""
        z = (hi[:, None] - self.seasonal[county][None, :]) / self.sigma[county]
        return _normal_cdf(z).mean(1)

    def summer(self, rng: np.random.Generator) -> Summer:
        c = int(rng.integers(SYNTHETIC_COUNTIES))
        year = int(rng.choice(YEARS))
        rho, sigma = self.rho[c], self.sigma[c]
        anomaly = np.empty(SUMMER_DAYS)
        anomaly[0] = rng.normal(0.0, sigma)
        noise = rng.normal(0.0, sigma * math.sqrt(1 - rho**2), SUMMER_DAYS)
        for d in range(1, SUMMER_DAYS):
            anomaly[d] = rho * anomaly[d - 1] + noise[d]
        hi = self.seasonal[c] + anomaly
        features = heat_features(hi / 100.0, self.percentile(c, hi)) | calendar_features(year)
        jitter = lambda coefficients: {k: v + rng.normal(0.0, 0.1) for k, v in coefficients.items()}
        baseline, effectiveness = jitter(SYNTHETIC_BASELINE), jitter(SYNTHETIC_EFFECTIVENESS)
        baseline["bias"] += self.bias_shift[c, 0]
        effectiveness["bias"] += self.bias_shift[c, 1]
        return Summer(self.counties[c], year, features, baseline, effectiveness)


class Weather2AlertData:
    """weather2alert's county summers and posterior reward coefficients, read from the files it downloads."""

    def __init__(self, data_dir: str | Path, weights: str = "nn_full_medicare_all", split: str = "65k",
                 counties: list[str] | None = None):
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        import yaml
        from safetensors.numpy import load_file

        root = Path(data_dir)
        paths = {
            "exogenous": root / "data" / split / "exogenous_states.parquet",
            "endogenous": root / "data" / split / "endogenous_states_actions.parquet",
            "posterior": root / weights / "posterior_samples.safetensors",
            "config": root / weights / "config.yaml",
        }
        missing = [str(p) for p in paths.values() if not p.is_file()]
        if missing:
            raise ConfigError(f"heatalerts (simulator: weather2alert) data_dir {str(root)!r} lacks {missing} (the files "
                              "weather2alert downloads from mauriciogtec/HeatAlertsRL-Data and -Models, in that layout)")
        fips_list = [str(f) for f in yaml.safe_load(paths["config"].read_text())["fips_list"]]
        posterior = load_file(str(paths["posterior"]))
        self.baseline = {k.removeprefix("baseline_"): v for k, v in posterior.items() if k.startswith("baseline_")}
        self.effectiveness = {k.removeprefix("effectiveness_"): v for k, v in posterior.items() if k.startswith("effectiveness_")}
        if not self.baseline or not self.effectiveness:
            raise ConfigError(f"heatalerts: {paths['posterior']} has no baseline_* / effectiveness_* coefficients")
        self.samples = next(iter(self.baseline.values())).shape[0]
        exogenous = pq.read_table(paths["exogenous"])
        endogenous = pq.read_table(paths["endogenous"])
        wanted = set(fips_list if counties is None else counties)
        unknown = sorted(wanted - set(fips_list))
        if unknown:
            raise ConfigError(f"heatalerts counties {unknown} are not in {paths['config']}'s fips_list")
        keep = lambda table: table.filter(pc.is_in(table["fips"], value_set=pa.array(sorted(wanted))))
        exogenous, endogenous = keep(exogenous), keep(endogenous)
        extra = [c for c in endogenous.column_names if c not in ("fips", "date", *ENDOGENOUS) and c not in exogenous.column_names]
        index = {(f, d): i for i, (f, d) in enumerate(zip(endogenous["fips"].to_pylist(), endogenous["date"].to_pylist()))}
        columns = {c: exogenous[c].to_numpy(zero_copy_only=False) for c in exogenous.column_names}
        rows = np.array([index.get(key, -1) for key in zip(columns["fips"], columns["date"])])
        for c in extra:
            values = endogenous[c].to_numpy(zero_copy_only=False).astype(np.float64)
            columns[c] = np.where(rows >= 0, values[np.maximum(rows, 0)], 0.0)
        self.summers: list[tuple[str, int, np.ndarray]] = []  # (county, year, row indices sorted by date)
        years = np.array([int(str(d)[:4]) for d in columns["date"]])
        for county in sorted(wanted):
            for year in sorted(set(years[columns["fips"] == county])):
                rows_of = np.flatnonzero((columns["fips"] == county) & (years == year))
                self.summers.append((county, int(year), rows_of[np.argsort(columns["date"][rows_of])]))
        if not self.summers:
            raise ConfigError(f"heatalerts: no data in {paths['exogenous']} for the counties {sorted(wanted)}")
        self.columns = columns
        self.fips_list = fips_list
        needed = (set(self.baseline) | set(self.effectiveness) | set(HeatAlertsEnv.OBSERVED)) - {"bias", *ENDOGENOUS}
        absent = sorted(needed - set(columns))
        if absent:
            raise ConfigError(f"heatalerts: the features {absent} (of the reward model or the observation) are not in the data files")

    def summer(self, rng: np.random.Generator) -> Summer:
        county, year, rows = self.summers[int(rng.integers(len(self.summers)))]
        features = {k: np.asarray(v[rows], dtype=np.float64) for k, v in self.columns.items() if k not in ("fips", "date")}
        features |= {k: v for k, v in calendar_features(year, len(rows)).items() if k not in features}
        sample, location = int(rng.integers(self.samples)), self.fips_list.index(county)
        pick = lambda coefficients: {k: float(v[sample, 0, location]) for k, v in coefficients.items()}
        return Summer(county, year, features, pick(self.baseline), pick(self.effectiveness))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


class HeatAlertsEnv(gym.Env):
    """Action 0: no alert, 1: alert. Observation: the day's features (:attr:`OBSERVED`) in order-one units."""

    metadata: ClassVar[dict] = {"render_modes": []}
    OBSERVED = ("heat_qi", "hi_max", "heat_qi_3d", "heat_qi_7d", "excess_heat_3d", "excess_heat_7d", "weekend", "holiday")
    SIMULATORS = ("synthetic", "weather2alert")

    def __init__(self, simulator: str = "synthetic", budget: int = 10, horizon: int = 32, penalty: float = 1.0,
                 data_dir: str | None = None, weights: str = "nn_full_medicare_all", split: str = "65k",
                 counties: list[str] | None = None):
        if simulator not in self.SIMULATORS:
            raise ConfigError(f"heatalerts env_kwargs.simulator must be one of {list(self.SIMULATORS)}, got {simulator!r}")
        if budget < 0 or horizon < 1 or not math.isfinite(penalty) or penalty < 0:
            raise ConfigError(f"heatalerts needs budget >= 0, horizon >= 1 and a finite penalty >= 0; got {budget}, {horizon}, {penalty}")
        if simulator == "weather2alert":
            if data_dir is None:
                raise ConfigError("heatalerts (simulator: weather2alert) needs env_kwargs.data_dir: the directory of "
                                  "weather2alert's downloaded data and model files")
            self.model = Weather2AlertData(data_dir, weights, split, counties)
        else:
            self.model = SyntheticCounties()
        self.budget, self.horizon, self.penalty = budget, horizon, penalty
        self.action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(len(self.OBSERVED) + 6,), dtype=np.float32)
        self.summer: Summer | None = None
        self.start = self.t = 0
        self.alerts: list[int] = []
        self.forecast_error = np.zeros((0, FORECAST_DAYS))

    # ---- state ----

    @property
    def day(self) -> int:
        """Today's index in the summer (a finished episode stays on its last day)."""
        return min(self.start + self.t, self.summer.days - 1)

    @property
    def remaining_budget(self) -> int:
        return self.budget - sum(self.alerts)

    def history_features(self) -> dict[str, float]:
        streak = 0
        for alert in reversed(self.alerts):
            if not alert:
                break
            streak += 1
        return {"alert_lag1": float(self.alerts[-1]) if self.alerts else 0.0, "alerts_2wks": float(sum(self.alerts[-14:])),
                "alert_streak": float(streak), "remaining_budget": float(self.remaining_budget)}

    def features(self) -> dict[str, float]:
        """Today's features (weather2alert's names), the agent's alert history included, and the bias."""
        return {k: float(v[self.day]) for k, v in self.summer.features.items()} | self.history_features() | {"bias": 1.0}

    def _observation(self) -> np.ndarray:
        f = self.features()
        history = [f["alert_lag1"], f["alerts_2wks"] / 14, f["alert_streak"] / 7, f["remaining_budget"] / max(self.budget, 1)]
        season = [f["dos"] / SUMMER_DAYS if "dos" in f else 0.0, self.t / self.horizon]
        return np.array([f[k] for k in self.OBSERVED] + history + season, dtype=np.float32)

    # ---- gymnasium ----

    def reward_of(self, action: int) -> float:
        """weather2alert's reward of today with ``action`` actually taken (module docstring)."""
        f = self.features()
        linear = lambda coefficients: sum(v * f.get(k, 0.0) for k, v in coefficients.items())
        baseline = _sigmoid(linear(self.summer.baseline))
        effectiveness = _sigmoid(linear(self.summer.effectiveness)) * (f["heat_qi"] > 0.5)
        return -REWARD_SCALE * baseline * (1.0 - effectiveness * action)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.summer = self.model.summer(self.np_random)
        self.start = int(self.np_random.integers(max(self.summer.days - self.horizon, 0) + 1))
        self.t = 0
        self.alerts = []
        # drawn once per episode, so a description reads the same however often it is rendered
        self.forecast_error = self.np_random.normal(0.0, 1.0, (self.summer.days, FORECAST_DAYS)) * 0.5 * np.arange(1, FORECAST_DAYS + 1)
        return self._observation(), {}

    def step(self, action: int):
        action = int(action)
        if action not in (0, 1):
            raise ValueError(f"action {action} outside {{0, 1}}")
        over_budget = action == 1 and self.remaining_budget <= 0
        reward = -self.penalty if over_budget else self.reward_of(action)
        self.alerts.append(0 if over_budget else action)
        self.t += 1
        truncated = self.t >= self.horizon or self.start + self.t >= self.summer.days
        return self._observation(), float(reward), False, truncated, {"invalid": over_budget}


class HeatAlertsLanguage(LanguageEnv):
    task = (
        "Assist policymakers in deciding when to issue public warnings to protect against heatwaves. Your goal is "
        "to minimise the long-term impact on health and mortality. Base your decision on the remaining budget, the "
        "weather, the day of the week, past warnings and the warnings left for the season. Warnings are most "
        "effective on days that are hot for the location and unexpectedly hotter than the days before, early in "
        "the summer; their protective effect lasts a day or two, and warning fatigue reduces the effect of "
        "warnings issued in a row. You may issue at most {budget} warnings in this period of {horizon} days."
    )
    example_rules = (  # the official HeatAlertsLang's examples, in flowkit's rule format
        '{"background": "Heat is more dangerous when unexpected, and unexpected early in summer. Alert fatigue decreases '
        'effectiveness.", "rule": "If the budget allows, issue an alert early in the summer when the heat is extreme '
        'and no more than 3 alerts were issued last week.", "state_relevance": "Check the day of summer, the heat '
        'quantile and the recent warnings."}',
        '{"background": "Alerts cannot be issued when the remaining budget is zero.", "rule": "If the remaining budget '
        'is zero, do not issue an alert.", "state_relevance": "Check the remaining warnings."}',
    )

    def __init__(self, **env_kwargs):
        super().__init__(HeatAlertsEnv(**env_kwargs))
        e = self.env.unwrapped
        self.task = type(self).task.format(budget=e.budget, horizon=e.horizon)

    def forecast(self) -> list[tuple[date, float]]:
        """The next days' heat index (°F) with an error growing by 0.5 °F std per day ahead (the official wrapper's
        forecast adds growing noise too), drawn at reset."""
        e = self.env.unwrapped
        hi = e.summer.features["hi_max"] * 100
        ahead = range(1, min(FORECAST_DAYS, e.summer.days - 1 - e.day) + 1)
        first = date(e.summer.year, 5, 1)
        return [(first + timedelta(e.day + k), hi[e.day + k] + e.forecast_error[e.day, k - 1]) for k in ahead]

    def describe(self) -> str:
        e = self.env.unwrapped
        f = e.features()
        today = date(e.summer.year, 5, 1) + timedelta(e.day)
        if e.remaining_budget <= 0:
            return f"{today:%A %Y-%m-%d}, day {e.t + 1} of {e.horizon}: the remaining budget is zero; no alert can be issued."
        recent = e.alerts
        hi = f["hi_max"] * 100
        week = e.summer.features["hi_max"][max(e.day - 6, 0): e.day + 1] * 100
        forecast = ", ".join(f"{d:%a %m-%d} {v:.0f} F" for d, v in self.forecast()) or "none (the summer ends)"
        return (
            f"Location: county {e.summer.county}. {today:%A %Y-%m-%d} (day {int(f.get('dos', e.day)) + 1} of summer; "
            f"day {e.t + 1} of {e.horizon} in this period). Remaining warnings (budget): {e.remaining_budget}. "
            f"Heat index today: {hi:.0f} F, the {100 * f['heat_qi']:.0f}th percentile for this location; average over "
            f"the past 7 days {week.mean():.0f} F (today {hi - week.mean():+.0f} F). Weekend: {'yes' if f['weekend'] else 'no'}; "
            f"holiday: {'yes' if f['holiday'] else 'no'}. Warnings in the last 14 / 7 / 3 days: {sum(recent[-14:])} / "
            f"{sum(recent[-7:])} / {sum(recent[-3:])}; current warning streak: {int(f['alert_streak'])} days. "
            f"Heat forecast for the next days: {forecast}."
        )

    def valid_actions(self) -> dict[int, str]:
        actions = {0: "do not issue a warning today"}
        if self.env.unwrapped.remaining_budget > 0:
            actions[1] = "issue a heat warning today"
        return actions

    def state_features(self) -> np.ndarray:
        return self.env.unwrapped._observation()
