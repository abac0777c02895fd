"""Rule reward r^rule ∈ [0, 1] (seed 002 §5.3): an LLM judge or an offline consistency judge."""

from __future__ import annotations

import logging

from flowkit.rbrl.backends import ChatBackend, ChatBackendError
from flowkit.rbrl.language import LanguageEnv, PromptSnapshot
from flowkit.rbrl.rules import Rule
from flowkit.rbrl.sources import Decision

log = logging.getLogger(__name__)


class Judge:
    """Base class: ``score(env, rule, decision)`` in [0, 1]. The agent calls it after the action was
    applied and explained (Alg. 1 line 8) with ``env`` the :class:`PromptSnapshot` of the state before it."""

    def score(self, env: LanguageEnv | PromptSnapshot, rule: Rule, decision: Decision) -> float:
        raise NotImplementedError


class ConsistencyJudge(Judge):
    """Offline judge for executable rules: does the rule alone determine the taken action?

    1 if the rule allows exactly the taken action, 0.5 if the taken action is one of several it allows
    (the rule does not pin the action down), 0 if the rule does not allow it.
    """

    def score(self, env: LanguageEnv | PromptSnapshot, rule: Rule, decision: Decision) -> float:
        if not rule.preferred:
            raise ValueError("ConsistencyJudge needs executable (template) rules; use LLMJudge for LLM-written rules")
        if decision.action not in rule.preferred:
            return 0.0
        return 1.0 if len(rule.preferred) == 1 else 0.5


QUESTIONS = (
    # ER1: without the action
    (
        "{prompt}\n\nRule: {rule}\n\nWithout knowing the chosen action, is this rule sufficient to determine the "
        "optimal action in the current state? Answer yes or no."
    ),
    # ER2
    (
        "{prompt}\n\nRule: {rule}\nBackground: {background}\nState relevance: {relevance}\n\nDoes the rule contain "
        "enough detail about its applicability to the current state? Answer yes or no."
    ),
    # ER3: with the action
    (
        "{prompt}\n\nRule: {rule}\nChosen action: {action}\n\nIs the rule compatible with the chosen action? "
        "Answer yes or no."
    ),
)


class LLMJudge(Judge):
    """The three yes/no questions of seed 002 §5.3 (ER1–ER3); r^rule = (1/3) Σ ER_i. An answer that is
    neither yes nor no (or a backend failure) scores 0 and is counted in ``unparsed``."""

    def __init__(self, backend: ChatBackend):
        self.backend = backend
        self.unparsed = 0

    def _yes(self, question: str) -> float:
        try:
            answer = self.backend.complete([{"role": "user", "content": question}]).strip().lower()
        except ChatBackendError as err:
            answer = f"<error: {err}>"
        word = answer.lstrip("\"'*` ").split(maxsplit=1)[0].strip(".,!:;\"'*`") if answer.strip() else ""
        if word in ("yes", "no"):
            return float(word == "yes")
        self.unparsed += 1
        log.warning("judge answer is neither yes nor no (%d so far): %.80r", self.unparsed, answer)
        return 0.0

    def score(self, env: LanguageEnv | PromptSnapshot, rule: Rule, decision: Decision) -> float:
        fields = {
            "prompt": env.prompt(), "rule": rule.rule, "background": rule.background,
            "relevance": rule.state_relevance, "action": env.valid_actions().get(decision.action, str(decision.action)),
        }
        return sum(self._yes(q.format(**fields)) for q in QUESTIONS) / len(QUESTIONS)
