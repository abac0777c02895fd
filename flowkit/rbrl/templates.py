"""Template rule libraries: the offline, deterministic rule source.

Every template rule is executable: ``preferred(env)`` lists the valid actions the rule allows in the
current state (best first), so the action follows from the rule. The libraries deliberately mix good,
mediocre and bad prioritisation strategies, as an LLM's candidate rules do (seed 002 Prop. 6.1 only
needs a good rule to be among the candidates); the selector has to learn which to follow when.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from flowkit.rbrl.language import LanguageEnv, PromptSnapshot
from flowkit.rbrl.rules import Rule
from flowkit.rbrl.sources import RuleSource


@dataclass(frozen=True)
class TemplateRule:
    name: str
    background: str
    rule: str
    preferred: Callable[[LanguageEnv], list[int]]

    def instantiate(self, env: LanguageEnv) -> Rule:
        preferred = tuple(self.preferred(env))
        valid = env.valid_actions()
        if not preferred or any(a not in valid for a in preferred):
            raise ValueError(f"template rule {self.name} proposed {preferred}; valid actions: {sorted(valid)}")
        if len(preferred) == 1:
            relevance = f"In the current state this means: {valid[preferred[0]]}."
        else:
            relevance = "In the current state it allows: " + "; ".join(valid[a] for a in preferred) + "."
        return Rule(self.background, self.rule, relevance, name=self.name, preferred=preferred)


# ---- bin packing -------------------------------------------------------------------------------------


def _fitting_levels(env) -> list[int]:
    return [a for a in env.valid_actions() if a > 0]


def _best_fit(env) -> list[int]:
    levels = _fitting_levels(env)
    return [max(levels)] if levels else [0]


def _worst_fit(env) -> list[int]:
    levels = _fitting_levels(env)
    return [min(levels)] if levels else [0]


def _exact_fit_else_new(env) -> list[int]:
    exact = env.unwrapped.capacity - env.unwrapped.item
    return [exact] if exact in _fitting_levels(env) else [0]


def _any_fit(env) -> list[int]:
    return _fitting_levels(env) or [0]


def _new_for_large(env) -> list[int]:
    return [0] if env.unwrapped.item >= 6 else _best_fit(env)


def _new_for_small(env) -> list[int]:
    return [0] if env.unwrapped.item <= 2 else _best_fit(env)


BINPACKING_RULES = (
    TemplateRule(
        "best_fit", "A fuller bag has less room left to waste, so topping it up closes gaps soonest.",
        "Put the item into the fullest open bag that still has room for it; open a new bag only if none fits.",
        _best_fit),
    TemplateRule(
        "exact_fit_else_new", "A bag filled exactly to capacity has zero waste.",
        "If some bag has exactly the item's size left free, fill it; otherwise open a new bag.",
        _exact_fit_else_new),
    TemplateRule(
        "worst_fit", "Bags with much free space can absorb the item without blocking later large items.",
        "Put the item into the emptiest open bag that has room for it; open a new bag only if none fits.",
        _worst_fit),
    TemplateRule(
        "any_fit", "Reusing open bags avoids the cost of new ones.",
        "Put the item into any open bag where it fits; open a new bag only if none fits.",
        _any_fit),
    TemplateRule(
        "new_for_large", "Large items fill most of a bag by themselves.",
        "Give every item of size 6 or more its own new bag; put smaller items into the fullest bag where they fit.",
        _new_for_large),
    TemplateRule(
        "new_for_small", "Small items are frequent, so they can start fresh bags that later items fill.",
        "Open a new bag for every item of size 2; put larger items into the fullest bag where they fit.",
        _new_for_small),
    TemplateRule(
        "always_new", "Keeping items apart keeps every bag easy to handle.",
        "Open a new bag for every item.",
        lambda env: [0]),
)


# ---- wearable devices --------------------------------------------------------------------------------


def _patients(env, score: np.ndarray, highest: bool = True) -> list[int]:
    """Give the device to the patient with the highest (or lowest) score, when budget allows."""
    hold = env.unwrapped.num_patients
    if env.unwrapped.budget_left <= 0:
        return [hold]
    return [int(np.argmax(score) if highest else np.argmin(score))]


def _highest_risk_when_needed(env, danger: float = -0.2) -> list[int]:
    risks = env.risks()
    if env.unwrapped.budget_left <= 0 or risks.min() > danger:
        return [env.unwrapped.num_patients]
    return [int(np.argmin(risks))]


def _any_at_risk(env) -> list[int]:
    hold = env.unwrapped.num_patients
    at_risk = [int(i) for i in np.flatnonzero(env.risks() < 0)]
    return at_risk if env.unwrapped.budget_left > 0 and at_risk else [hold]


WEARABLES_RULES = (
    TemplateRule(
        "highest_risk", "The reward charges each patient's current risk, so the riskiest patient gains most.",
        "Give the device to the patient with the highest current risk penalty.",
        lambda env: _patients(env, env.risks(), highest=False)),
    TemplateRule(
        "highest_risk_when_needed", "Budget is limited; spend it only when someone is clearly in danger.",
        "Give the device to the highest-risk patient only if that patient's risk penalty exceeds 0.2; otherwise keep it.",
        _highest_risk_when_needed),
    TemplateRule(
        "highest_temperature", "Fever is an early sign of infection after delivery.",
        "Give the device to the patient with the highest temperature.",
        lambda env: _patients(env, env.unwrapped.vitals[:, 0])),
    TemplateRule(
        "lowest_spo2", "Low oxygen saturation is an acute danger sign.",
        "Give the device to the patient with the lowest SpO2.",
        lambda env: _patients(env, env.unwrapped.vitals[:, 3], highest=False)),
    TemplateRule(
        "highest_pulse", "Tachycardia can signal haemorrhage.",
        "Give the device to the patient with the highest pulse.",
        lambda env: _patients(env, env.unwrapped.vitals[:, 1])),
    TemplateRule(
        "any_at_risk", "Any patient beyond a threshold may deteriorate.",
        "Give the device to a patient who has at least one vital sign beyond its threshold.",
        _any_at_risk),
    TemplateRule(
        "most_stable", "Stable patients respond best to monitoring and stay healthy.",
        "Give the device to the patient with the lowest current risk penalty.",
        lambda env: _patients(env, env.risks())),
    TemplateRule(
        "save_budget", "Devices are scarce and may be needed more later.",
        "Keep the device unused this step.",
        lambda env: [env.unwrapped.num_patients]),
)


# ---- wearable devices, Boehmer et al.'s simulator (flowkit.rbrl.boehmer) -----------------------------


def _free_first(env, worn_score=None) -> list[int]:
    """A free device if there is one; else the worn device with the highest ``worn_score(env)``
    (device 0 when no score is given)."""
    devices = env.unwrapped.devices
    free = [i for i, p in enumerate(devices) if p is None]
    if free:
        return [free[0]]
    return [int(np.argmax(worn_score(env)))] if worn_score else [0]


def _volatility(env) -> np.ndarray:
    return np.array([p.history.std(1).sum() for p in env.unwrapped.devices])


BOEHMER_RULES = (
    TemplateRule(
        "free_else_lowest_risk", "Free devices cost nothing to give; a patient at low risk loses least without one.",
        "Give a free device if there is one; otherwise take the device of the patient with the lowest current risk.",
        lambda env: _free_first(env, lambda e: e.risks())),
    TemplateRule(
        "free_else_longest_worn", "A patient near the end of her stay has the fewest unmonitored steps left.",
        "Give a free device if there is one; otherwise take the device worn the longest.",
        lambda env: _free_first(env, lambda e: np.array([p.worn for p in e.unwrapped.devices]))),
    TemplateRule(
        "free_else_most_stable", "Stable vital signs are unlikely to deteriorate without monitoring.",
        "Give a free device if there is one; otherwise take the device of the patient with the least volatile vital signs.",
        lambda env: _free_first(env, lambda e: -_volatility(e))),
    TemplateRule(
        "free_else_first", "Free devices cost nothing to give.",
        "Give a free device if there is one; otherwise take device 0.",
        _free_first),
    TemplateRule(
        "highest_risk", "A patient in danger needs the doctors' attention more than the device.",
        "Take the device of the patient with the highest current risk, even if another device is free.",
        lambda env: [int(np.argmin(env.risks()))]),
    TemplateRule(
        "always_first", "Using one device keeps the routine simple.",
        "Always give device 0 to the new patient.",
        lambda env: [0]),
)

# ---- heat alerts (flowkit.rbrl.heatalerts) ----------------------------------------------------------------


def _warn_if(condition: Callable[[dict, LanguageEnv], bool]) -> Callable[[LanguageEnv], list[int]]:
    """Warn (1) when ``condition(today's features, env)`` holds and budget is left, else no warning (0)."""

    def preferred(env) -> list[int]:
        features = env.unwrapped.features()
        return [1] if features["remaining_budget"] > 0 and condition(features, env) else [0]

    return preferred


def _hottest_ahead(features: dict, env) -> bool:
    forecast = [hi for _, hi in env.forecast()[:3]]
    return features["heat_qi"] >= 0.8 and all(features["hi_max"] * 100 >= hi for hi in forecast)


HEATALERTS_RULES = (
    TemplateRule(
        "never", "Warnings are costly to credibility.", "Never issue a warning.", lambda env: [0]),
    TemplateRule(
        "whenever_budget", "Any warning may prevent some harm.", "Issue a warning whenever the budget allows.",
        _warn_if(lambda f, env: True)),
    TemplateRule(
        "hot_day", "Hospitalisations rise on days that are hot for the location.",
        "Issue a warning when today's heat index is at or above the 90th percentile for this location.",
        _warn_if(lambda f, env: f["heat_qi"] >= 0.9)),
    TemplateRule(
        "very_hot_day", "Only the most extreme heat justifies a scarce warning.",
        "Issue a warning only when today's heat index is at or above the 95th percentile for this location.",
        _warn_if(lambda f, env: f["heat_qi"] >= 0.95)),
    TemplateRule(
        "unexpected_heat", "Heat is most dangerous when people are not used to it yet.",
        "Issue a warning when today is hot (75th percentile or above) and clearly hotter than the last three days.",
        _warn_if(lambda f, env: f["heat_qi"] >= 0.75 and f["excess_heat_3d"] >= 0.1)),
    TemplateRule(
        "hot_no_streak", "Warnings issued in a row lose their effect (warning fatigue).",
        "Issue a warning on days at or above the 90th percentile, unless a warning was issued yesterday.",
        _warn_if(lambda f, env: f["heat_qi"] >= 0.9 and not f["alert_lag1"])),
    TemplateRule(
        "hot_weekend", "People are outdoors more at weekends and on holidays.",
        "Issue a warning on hot (75th percentile or above) weekend days and holidays.",
        _warn_if(lambda f, env: f["heat_qi"] >= 0.75 and (f["weekend"] or f["holiday"]))),
    TemplateRule(
        "hottest_ahead", "A warning is best spent on the peak of a heatwave.",
        "Issue a warning when today is hot (80th percentile or above) and no hotter day is forecast in the next three days.",
        _warn_if(_hottest_ahead)),
)

LIBRARIES = {"binpacking": BINPACKING_RULES, "wearables": WEARABLES_RULES, "boehmer": BOEHMER_RULES,
             "heatalerts": HEATALERTS_RULES}


class TemplateRuleSource(RuleSource):
    """Rules from a fixed library (offline default): all of them (or ``num_rules`` sampled) each step,
    in a shuffled order so the selector cannot rely on positions."""

    def __init__(self, library: str, num_rules: int | None = None, shuffle: bool = True, seed: int = 0):
        if library not in LIBRARIES:
            raise ValueError(f"unknown rule library {library!r}; choose from {sorted(LIBRARIES)}")
        self.library = LIBRARIES[library]
        self.num_rules = num_rules or len(self.library)
        if not 1 <= self.num_rules <= len(self.library):
            raise ValueError(f"num_rules must be in [1, {len(self.library)}]")
        self.shuffle = shuffle
        self.rng = np.random.default_rng(seed)

    @property
    def rule_names(self) -> list[str]:
        return [r.name for r in self.library]

    def seed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def generate(self, env: LanguageEnv) -> list[Rule]:
        order = np.arange(len(self.library))
        if self.shuffle:
            order = self.rng.permutation(order)
        return [self.library[i].instantiate(env) for i in order[: self.num_rules]]

    def act(self, env: LanguageEnv, rule: Rule) -> int:
        return rule.preferred[0]

    def explain(self, before: PromptSnapshot, rule: Rule, action: int) -> str:
        return f"I {before.valid_actions()[action]} because of the rule: {rule.rule} {rule.state_relevance}"
