"""Rules (seed 002 §4.2): JSON {background, rule, state_relevance}, and the parser for LLM output."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

RULE_FIELDS = ("background", "rule", "state_relevance")


@dataclass(frozen=True)
class Rule:
    """One candidate rule for the current state.

    ``preferred``: for executable (template) rules, the valid actions the rule allows in this state, best
    first — more than one means the rule does not pin the action down. Empty for LLM-written rules,
    whose action comes from the LLM (seed 002 Alg. 1 line 5). ``name`` identifies a template rule
    across states (used for the fixed-rule baselines). ``thoughts``: the chain-of-thought the rule was
    written from (Alg. 1 line 3), passed on to the action and explanation prompts; not part of the rule's
    JSON or embedding.
    """

    background: str
    rule: str
    state_relevance: str
    name: str | None = None
    preferred: tuple[int, ...] = field(default=())
    thoughts: str = ""

    @property
    def embedding_text(self) -> str:
        """What the sentence encoder sees: the state-independent part. The state itself reaches the
        selector numerically (seed 002 §5.2), and keeping the text state-free lets embeddings be cached."""
        return f"{self.rule} {self.background}"

    def as_json(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in RULE_FIELDS}


class RuleParseError(ValueError):
    """LLM output that is not a valid rule list; ``str(err)`` says why."""


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def parse_rules(text: str, max_chars: int = 8000, max_rules: int = 20, max_field_chars: int = 1000) -> list[Rule]:
    """Parse ``[{"background": ..., "rule": ..., "state_relevance": ...}, ...]`` (or ``{"rules": [...]}``).

    The schema is strict: each rule has exactly the three fields, each a non-empty string of at most
    ``max_field_chars`` characters. A surrounding Markdown code fence is allowed. Raises
    :class:`RuleParseError` with the reason otherwise, including output longer than ``max_chars``.
    """
    if len(text) > max_chars:
        raise RuleParseError(f"output is {len(text)} characters, over the limit of {max_chars}")
    fenced = _FENCE.search(text)
    body = (fenced.group(1) if fenced else text).strip()
    try:
        data = json.loads(body)
    except json.JSONDecodeError as err:
        raise RuleParseError(f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    if isinstance(data, dict) and set(data) == {"rules"}:
        data = data["rules"]
    if isinstance(data, dict) and set(data) == set(RULE_FIELDS):
        data = [data]
    if not isinstance(data, list):
        raise RuleParseError(f"expected a JSON list of rules, got {type(data).__name__}")
    if not data:
        raise RuleParseError("the rule list is empty")
    if len(data) > max_rules:
        raise RuleParseError(f"{len(data)} rules, over the limit of {max_rules}")
    rules = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise RuleParseError(f"rule {i}: expected an object, got {type(item).__name__}")
        missing = [k for k in RULE_FIELDS if k not in item]
        if missing:
            raise RuleParseError(f"rule {i}: missing field(s) {', '.join(missing)}")
        extra = sorted(set(item) - set(RULE_FIELDS))
        if extra:
            raise RuleParseError(f"rule {i}: unexpected field(s) {', '.join(extra)}")
        for key in RULE_FIELDS:
            value = item[key]
            if not isinstance(value, str) or not value.strip():
                raise RuleParseError(f"rule {i}: field {key} must be a non-empty string")
            if len(value) > max_field_chars:
                raise RuleParseError(f"rule {i}: field {key} has {len(value)} characters, over {max_field_chars}")
        rules.append(Rule(**{k: item[k].strip() for k in RULE_FIELDS}))
    return rules
