"""What a selector did, from its step records: the chosen rules' shares and the agreement with each fixed rule."""

import pytest

from flowkit.rbrl.agent import StepRecord, selection_diagnostics


def _step(chosen: int | None, action: int, names=("a", "b", None), fixed=None) -> StepRecord:
    return StepRecord(t=0, state_text="", rules=[{"rule": str(n), "name": n} for n in names], chosen=chosen, action=action,
                      action_text="", explanation="", env_reward=0.0, rule_reward=1.0, fixed_actions=fixed or {})


def test_chosen_shares_and_action_agreement_hand_computed():
    records = [
        _step(0, 1, fixed={"a": 1, "b": 1}),  # chose a; both rules take action 1 here
        _step(0, 2, fixed={"a": 2, "b": 0}),
        _step(1, 0, fixed={"a": 2, "b": 0}),
        _step(2, 5, fixed={"a": 5, "b": 3}),  # an unnamed (LLM-written) rule, which happened to act as a
        _step(None, 4),  # no rules this step: not the selector's choice, not counted
    ]
    diagnostics = selection_diagnostics(records)
    assert diagnostics["chosen"] == {"a": pytest.approx(0.5), "b": pytest.approx(0.25)}
    assert diagnostics["agreement"] == {"a": pytest.approx(0.75), "b": pytest.approx(0.5)}


def test_no_named_rules_or_no_choices():
    assert selection_diagnostics([_step(0, 1, names=(None,))]) == {"chosen": {}, "agreement": {}}
    assert selection_diagnostics([_step(None, 1)]) == {"chosen": {}, "agreement": {}}
