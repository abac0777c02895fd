"""One RBRL agent step (seed 002 Alg. 1 lines 3–10) and episode evaluation.

A step runs in the paper's order: rules for s_t (line 3, done when the state is observed), the rule
chosen by the caller (line 4), the action from the rule (line 5), the environment step (line 6), the
explanation of the applied action (line 7), the rule reward (line 8); both about the prompt p_t of the
state the action was chosen in.

The rule selection itself is a callback ``choose(observation) -> rule index`` so the same loop serves
the trained selector, uniform-random choice and fixed-rule baselines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from flowkit.rbrl.encoder import EmbeddingCache
from flowkit.rbrl.judges import Judge
from flowkit.rbrl.language import LanguageEnv
from flowkit.rbrl.rules import Rule
from flowkit.rbrl.sources import Decision, RuleGenerationError, RuleSource

log = logging.getLogger(__name__)


@dataclass
class Observation:
    """The augmented state s̃_t: numeric state, candidate rules and their embeddings (R×E)."""

    state: Tensor
    rules: list[Rule]
    embeddings: Tensor


@dataclass
class StepRecord:
    """What happened at one step; the explanation log and ``flowkit explain-rules`` print these."""

    t: int
    state_text: str
    rules: list[dict]
    chosen: int | None
    action: int
    action_text: str
    explanation: str
    env_reward: float
    rule_reward: float | None  # None: the judge could not score the rule (its backend failed)
    probabilities: list[float] = field(default_factory=list)
    fixed_actions: dict[str, int] = field(default_factory=dict)  # named executable rule → the action it takes here


Chooser = Callable[[Observation], int]


class RuleAgent:
    """Drives one :class:`LanguageEnv` with a rule source, a judge and the embedding cache."""

    def __init__(self, env: LanguageEnv, source: RuleSource, judge: Judge, embeddings: EmbeddingCache, max_rules: int):
        self.env = env
        self.source = source
        self.judge = judge
        self.embeddings = embeddings
        self.max_rules = max_rules
        self.generation_failures = 0
        self.t = 0

    def reset(self, seed: int) -> Observation:
        self.env.reset(seed=seed)
        self.source.seed(seed)
        self.t = 0
        return self.observe()

    def observe(self) -> Observation:
        state = torch.from_numpy(self.env.state_features())
        try:
            rules = self.source.generate(self.env)[: self.max_rules]
        except RuleGenerationError as err:
            self.generation_failures += 1  # the source has already warned, with its reason and counts
            log.info("no rules for this state (%d failures so far): %s", self.generation_failures, err)
            rules = []
        embeddings = self.embeddings([r.embedding_text for r in rules]) if rules else torch.zeros(0, 0)
        return Observation(state, rules, embeddings)

    def step(self, obs: Observation, chosen: int | None, probabilities: list[float] | None = None):
        """Apply rule ``chosen`` (None when the source gave no rules). Without a rule, or when the source
        could not say which action the rule takes, a random valid action is taken and there is no rule reward.

        Returns (env_reward, rule_reward, done, next observation or None when done, record); the rule
        reward is None when there is none to learn from: no rule, no action from it, or the judge could not
        score the rule (its backend failed)."""
        before = self.env.snapshot()
        valid = before.valid_actions()
        action = None if chosen is None else self.source.act(self.env, obs.rules[chosen])
        followed = action is not None
        if not followed:
            action = int(self.env.np_random.choice(sorted(valid)))
        _, env_reward, terminated, truncated, _ = self.env.step(action)
        rule_reward = None
        if chosen is None:
            explanation = "no valid rules were produced for this state; a random valid action was taken"
        elif not followed:
            explanation = "the selected rule gave no valid action; a random valid action was taken"
        else:
            rule = obs.rules[chosen]
            explanation = self.source.explain(before, rule, action)
            rule_reward = self.judge.score(before, rule, Decision(action, explanation))
        record = StepRecord(
            t=self.t, state_text=before.describe(), rules=[r.as_json() | {"name": r.name} for r in obs.rules],
            chosen=chosen, action=action, action_text=valid.get(action, f"invalid action {action}"),
            explanation=explanation, env_reward=float(env_reward), rule_reward=rule_reward,
            probabilities=probabilities or [],
            fixed_actions={r.name: r.preferred[0] for r in obs.rules if r.name is not None and r.preferred},
        )
        self.t += 1
        done = terminated or truncated
        return float(env_reward), rule_reward, done, (None if done else self.observe()), record


def run_episode(agent: RuleAgent, choose: Chooser, seed: int) -> tuple[float, list[StepRecord]]:
    """Environment return of one episode (rule rewards are recorded, not added)."""
    obs = agent.reset(seed)
    total, records = 0.0, []
    while obs is not None:
        chosen = choose(obs) if obs.rules else None
        env_reward, _, _, obs, record = agent.step(obs, chosen)
        total += env_reward
        records.append(record)
    return total, records


def random_chooser(seed: int) -> Chooser:
    rng = np.random.default_rng(seed)
    return lambda obs: int(rng.integers(len(obs.rules)))


def fixed_rule_chooser(name: str) -> Chooser:
    def choose(obs: Observation) -> int:
        for i, rule in enumerate(obs.rules):
            if rule.name == name:
                return i
        raise LookupError(f"rule {name!r} is not among this step's candidates")

    return choose


def evaluate(
    agent: RuleAgent, choose_for_seed: Callable[[int], Chooser], seeds: list[int], episodes: int,
    records: list[StepRecord] | None = None,
) -> np.ndarray:
    """Mean episode return per evaluation seed (episode seeds ``1000·seed + k``), shape (len(seeds),);
    every step's record is appended to ``records`` when given."""
    means = []
    for seed in seeds:
        choose = choose_for_seed(seed)
        returns = []
        for k in range(episodes):
            total, steps = run_episode(agent, choose, 1000 * seed + k)
            returns.append(total)
            if records is not None:
                records.extend(steps)
        means.append(float(np.mean(returns)))
    return np.asarray(means)


def selection_diagnostics(records: list[StepRecord]) -> dict[str, dict[str, float]]:
    """What a selector did over ``records`` (the steps where it chose a rule):

    - ``chosen``: fraction of steps it chose each named rule (LLM-written rules have no name: empty for them);
    - ``agreement``: for each named executable rule, the fraction of steps where the action taken equals
      the action that rule takes in that state — 1.0 means the selector behaved exactly as that fixed rule
      (rules that tie on most states agree often without being chosen).
    """
    steps = [r for r in records if r.chosen is not None]
    if not steps:
        return {"chosen": {}, "agreement": {}}
    names = [r.rules[r.chosen].get("name") for r in steps]
    chosen = {name: names.count(name) / len(steps) for name in sorted(set(names) - {None})}
    rules = sorted({name for r in steps for name in r.fixed_actions})
    agreement = {
        name: float(np.mean([r.fixed_actions.get(name) == r.action for r in steps])) for name in rules
    }
    return {"chosen": chosen, "agreement": agreement}
