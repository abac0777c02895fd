import numpy as np
import pytest

from flowkit.rbrl.envs import ENVIRONMENTS, make_env
from flowkit.rbrl.judges import ConsistencyJudge
from flowkit.rbrl.rules import Rule
from flowkit.rbrl.sources import Decision
from flowkit.rbrl.templates import LIBRARIES, TemplateRuleSource


@pytest.mark.parametrize("name", sorted(set(LIBRARIES) & set(ENVIRONMENTS)))  # "boehmer": tests/rbrl/test_boehmer.py
def test_every_template_rule_gives_valid_actions_along_random_episodes(name):
    env = make_env(name)
    source = TemplateRuleSource(name, seed=0)
    rng = np.random.default_rng(0)
    for episode in range(3):
        env.reset(seed=episode)
        done = False
        while not done:
            rules = source.generate(env)  # instantiate() asserts validity
            assert sorted(r.name for r in rules) == sorted(source.rule_names)
            rule = rules[int(rng.integers(len(rules)))]
            before = env.snapshot()
            action = source.act(env, rule)
            assert action == rule.preferred[0]
            _, _, terminated, truncated, info = env.step(action)
            done = terminated or truncated
            assert not info["invalid"]
            explanation = source.explain(before, rule, action)
            assert rule.rule in explanation and before.valid_actions()[action] in explanation


def test_binpacking_rules_hand_checked():
    env = make_env("binpacking")
    env.reset(seed=0)
    e = env.unwrapped
    e.counts[:] = 0
    e.counts[3], e.counts[5], e.counts[6] = 1, 1, 1
    e.item = 3
    rules = {r.name: r for r in TemplateRuleSource("binpacking").generate(env)}
    assert rules["best_fit"].preferred == (6,)
    assert rules["worst_fit"].preferred == (3,)
    assert rules["exact_fit_else_new"].preferred == (6,)
    assert rules["any_fit"].preferred == (3, 5, 6)
    assert rules["new_for_small"].preferred == (6,)
    assert rules["always_new"].preferred == (0,)
    assert "bag at level 6" in rules["best_fit"].state_relevance


def test_wearables_rules_hand_checked():
    env = make_env("wearables", num_patients=3)
    env.reset(seed=0)
    env.unwrapped.vitals = np.array([[39.5, 100.0, 20.0, 97.0], [37.0, 80.0, 16.0, 98.0], [37.5, 130.0, 34.0, 85.0]])
    rules = {r.name: r for r in TemplateRuleSource("wearables").generate(env)}
    assert rules["highest_risk"].preferred == (2,)
    assert rules["highest_temperature"].preferred == (0,)
    assert rules["most_stable"].preferred == (1,)
    assert rules["any_at_risk"].preferred == (0, 2)
    assert rules["save_budget"].preferred == (3,)
    env.unwrapped.budget_left = 0
    rules = TemplateRuleSource("wearables").generate(env)
    assert all(r.preferred == (3,) for r in rules)


def test_source_subsamples_and_shuffles_reproducibly():
    env = make_env("binpacking")
    env.reset(seed=0)
    source = TemplateRuleSource("binpacking", num_rules=4, seed=5)
    first = [r.name for r in source.generate(env)]
    source.seed(5)
    assert [r.name for r in source.generate(env)] == first and len(first) == 4
    orders = {tuple(r.name for r in source.generate(env)) for _ in range(10)}
    assert len(orders) > 1


def test_consistency_judge():
    judge = ConsistencyJudge()
    env = make_env("binpacking")
    env.reset(seed=0)
    one = Rule("b", "r", "s", preferred=(3,))
    several = Rule("b", "r", "s", preferred=(3, 5))
    assert judge.score(env, one, Decision(3, "")) == 1.0
    assert judge.score(env, several, Decision(5, "")) == 0.5
    assert judge.score(env, one, Decision(0, "")) == 0.0
    with pytest.raises(ValueError, match="executable"):
        judge.score(env, Rule("b", "r", "s"), Decision(0, ""))
