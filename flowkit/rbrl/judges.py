"""Rule reward r^rule ∈ [0, 1] (seed 002 §5.3): an LLM judge or an offline consistency judge."""

from __future__ import annotations

import logging

from flowkit.rbrl.backends import ChatBackend, ChatBackendError, FailureStreak, check_temperature
from flowkit.rbrl.language import LanguageEnv, PromptSnapshot
from flowkit.rbrl.rules import Rule
from flowkit.rbrl.sources import Decision

log = logging.getLogger(__name__)


class Judge:
    """Base class: ``score(env, rule, decision)`` in [0, 1], or None when the judge could not score the rule
    (never 0 in its place: a missing score is not a bad rule). The agent calls it after the action was
    applied and explained (Alg. 1 line 8) with ``env`` the :class:`PromptSnapshot` of the state before it."""

    def score(self, env: LanguageEnv | PromptSnapshot, rule: Rule, decision: Decision) -> float | None:
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
    """The three yes/no questions of seed 002 §5.3 (ER1–ER3); r^rule = (1/3) Σ ER_i, asked at ``temperature``
    (default 0: the official judge's first call is greedy; ``null``: the backend's own).

    An answer that is neither yes nor no (e.g. a refusal in words) is the model's answer: it scores 0 and is
    counted in ``unparsed`` (each logged at INFO; the first of a run as a warning). A backend failure is no
    answer: the step gets no rule reward (``score`` returns None, the transition is not learned from), it is
    counted in ``failures.total``, and ``max_consecutive_failures`` failed steps in a row stop the run with a
    one-line error (:class:`~flowkit.rbrl.backends.FailureStreak`).
    """

    def __init__(self, backend: ChatBackend, temperature: float | None = 0.0, max_consecutive_failures: int = 5):
        check_temperature("LLMJudge.temperature", temperature)
        self.backend = backend
        self.temperature = temperature
        self.failures = FailureStreak("LLMJudge", "chat backend calls", max_consecutive_failures,
                                      "LLMJudge.max_consecutive_failures")
        self.unparsed = 0

    def _yes(self, answer: str) -> float:
        answer = answer.strip().lower()
        word = answer.lstrip("\"'*` ").split(maxsplit=1)[0].strip(".,!:;\"'*`") if answer else ""
        if word in ("yes", "no"):
            return float(word == "yes")
        self.unparsed += 1
        log.log(logging.WARNING if self.unparsed == 1 else logging.INFO,
                "judge answer is neither yes nor no, scored 0 (%d so far): %.80r", self.unparsed, answer)
        return 0.0

    def score(self, env: LanguageEnv | PromptSnapshot, rule: Rule, decision: Decision) -> float | None:
        fields = {
            "prompt": env.prompt(), "rule": rule.rule, "background": rule.background,
            "relevance": rule.state_relevance, "action": env.valid_actions().get(decision.action, str(decision.action)),
        }
        answers = []
        for question in QUESTIONS:
            try:
                reply = self.backend.complete([{"role": "user", "content": question.format(**fields)}], temperature=self.temperature)
            except ChatBackendError as err:
                self.failures.failed(str(err))
                return None
            self.failures.succeeded()
            answers.append(self._yes(reply))
        return sum(answers) / len(answers)
