"""Rules and actions written by a chat LLM (seed 002 §5.1, §5.3; prompts after its Fig. 11)."""

from __future__ import annotations

import json
import logging

from flowkit.rbrl.backends import ChatBackend, ChatBackendError
from flowkit.rbrl.language import LanguageEnv
from flowkit.rbrl.rules import Rule, RuleParseError, parse_rules
from flowkit.rbrl.sources import Decision, RuleGenerationError, RuleSource

log = logging.getLogger(__name__)

SYSTEM = "You are a careful decision-making assistant. Reply with JSON only, no prose."

RULES_PROMPT = """{prompt}

Write {n} different candidate rules for choosing the next action. A rule is a prioritisation
statement of the form "if/when ..., prioritise/do ...". Reply with a JSON list of {n} objects, each with
exactly these string fields: "background" (why the rule makes sense for this task), "rule" (the
statement), "state_relevance" (how it applies to the current state)."""

ACTION_PROMPT = """{prompt}

Follow this rule: {rule}
Background: {background}
Relevance to the current state: {relevance}

Reply with a JSON object {{"action": <one of the valid action numbers>, "explanation": "<why this action follows from the rule>"}}."""


class LLMRuleSource(RuleSource):
    """Rule sets and rule-following actions from any :class:`ChatBackend`.

    Output that fails :func:`parse_rules` (or a backend error) is retried up to ``max_attempts`` times;
    then the state is skipped (:class:`RuleGenerationError`) and counted in ``skipped``. Likewise an
    action reply that is not a valid action is retried, then replaced by the first valid action and
    counted in ``fallback_actions``.
    """

    def __init__(self, backend: ChatBackend, num_rules: int = 10, max_attempts: int = 3, max_chars: int = 8000):
        self.backend = backend
        self.num_rules = num_rules
        self.max_attempts = max_attempts
        self.max_chars = max_chars
        self.invalid_outputs = 0
        self.skipped = 0
        self.fallback_actions = 0

    def seed(self, seed: int) -> None:
        """Nothing to reset: the randomness is the backend's sampling."""

    def _ask(self, content: str) -> str:
        return self.backend.complete([{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}])

    def generate(self, env: LanguageEnv) -> list[Rule]:
        content = RULES_PROMPT.format(prompt=env.prompt(), n=self.num_rules)
        reason = ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                return parse_rules(self._ask(content), max_chars=self.max_chars, max_rules=self.num_rules)
            except (RuleParseError, ChatBackendError) as err:
                self.invalid_outputs += 1
                reason = str(err)
                log.info("rule generation attempt %d/%d rejected: %s", attempt, self.max_attempts, reason)
        self.skipped += 1
        log.warning(
            "rule generation skipped after %d invalid attempts (%d states skipped, %d invalid outputs so far): %s",
            self.max_attempts, self.skipped, self.invalid_outputs, reason,
        )
        raise RuleGenerationError(reason)

    def act(self, env: LanguageEnv, rule: Rule) -> Decision:
        valid = env.valid_actions()
        content = ACTION_PROMPT.format(prompt=env.prompt(), rule=rule.rule, background=rule.background, relevance=rule.state_relevance)
        for _ in range(self.max_attempts):
            try:
                reply = json.loads(self._ask(content).strip().removeprefix("```json").removesuffix("```"))
                action, explanation = int(reply["action"]), str(reply["explanation"])
            except (ChatBackendError, json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            if action in valid:
                return Decision(action, explanation)
        self.fallback_actions += 1
        log.warning("no valid action from the LLM (%d fallbacks so far); taking the first valid action", self.fallback_actions)
        first = min(valid)
        return Decision(first, f"(the LLM gave no valid action; fell back to: {valid[first]})")
