import json
import re

import pytest

from flowkit.rbrl.rules import Rule, RuleParseError, parse_rules

GOOD = {"background": "Full bags waste nothing.", "rule": "Fill the fullest bag.", "state_relevance": "A bag is at level 7."}


def test_parses_list_object_and_code_fence():
    rules = parse_rules(json.dumps([GOOD, GOOD | {"rule": "Open a new bag."}]))
    assert [r.rule for r in rules] == ["Fill the fullest bag.", "Open a new bag."]
    assert isinstance(rules[0], Rule) and rules[0].preferred == () and rules[0].name is None
    assert parse_rules(json.dumps({"rules": [GOOD]}))[0].as_json() == GOOD
    assert len(parse_rules("Here you go:\n```json\n" + json.dumps([GOOD]) + "\n```")) == 1
    assert len(parse_rules(json.dumps(GOOD))) == 1  # a single rule object


@pytest.mark.parametrize(
    "text,reason",
    [
        ("not json at all", "not valid JSON"),
        ('[{"background": "a", "rule": "b"', "not valid JSON"),
        ("42", "expected a JSON list"),
        ("[]", "empty"),
        (json.dumps(["a rule"]), "rule 0: expected an object"),
        (json.dumps([{"background": "a", "rule": "b"}]), "missing field(s) state_relevance"),
        (json.dumps([GOOD | {"priority": 1}]), "unexpected field(s) priority"),
        (json.dumps([GOOD | {"rule": ""}]), "field rule must be a non-empty string"),
        (json.dumps([GOOD | {"rule": 3}]), "field rule must be a non-empty string"),
        (json.dumps([GOOD, GOOD | {"background": "x" * 1001}]), "rule 1: field background has 1001 characters"),
        (json.dumps([GOOD] * 21), "21 rules, over the limit of 20"),
    ],
)
def test_rejects_malformed_output_with_reason(text, reason):
    with pytest.raises(RuleParseError, match=re.escape(reason)):
        parse_rules(text)


def test_rejects_oversized_output_before_parsing():
    text = json.dumps([GOOD] * 5)
    with pytest.raises(RuleParseError, match=f"output is {len(text)} characters, over the limit of 100"):
        parse_rules(text, max_chars=100)
