"""Rule reward r^rule ∈ [0, 1] (seed 002 §5.3): an LLM judge or an offline consistency judge."""

from __future__ import annotations

import json
import logging
import re

from flowkit.errors import ConfigError
from flowkit.llm.chat_backends import ChatBackend, ChatBackendError, FailureStreak, check_temperature
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

# the official agents.py's two calls, two questions each (in flowkit's words)
OFFICIAL_QUESTIONS = (
    (
        "{prompt}\n\n### Rule evaluation\nEvaluate how useful this rule is to determine the optimal action:\n\n"
        "Rule: {rule}\nBackground: {background}\n\nAnswer each question with 1 (yes) or 0 (no).\n"
        "q1. Is the rule sufficient to predict the exact action the system will take in the current state?\n"
        "q2. Is the rule's background free of hallucinations and relevant to the current state?\n"
        'Reply with JSON only, for example {{"q1": 1, "q2": 0}}.'
    ),
    (
        "{prompt}\n\n### Rule evaluation\nEvaluate whether this rule is compatible with the current state and the "
        "action taken.\n\nAction taken: {action}\nRule: {rule}\nBackground: {background}\n\nAnswer each question "
        "with 1 (yes) or 0 (no).\n"
        "q1. Did the rule predict the action that was taken (0 if they contradict)?\n"
        "q2. Is the rule's background free of hallucinations and relevant to the current state?\n"
        'Reply with JSON only, for example {{"q1": 1, "q2": 0}}.'
    ),
)
_BRACES = re.compile(r"\{[^{}]*\}")


class LLMJudge(Judge):
    """The rule reward r^rule of seed 002 §5.3 from an LLM, in one of two forms (``questions``):

    - ``"official"`` (default; the official ``agents.py``, which produced the paper's runs): two calls, each asking
      two questions answered as JSON ``{"q1": 0|1, "q2": 0|1}`` — before seeing the action, whether the rule is
      sufficient to predict the exact action and whether its background is free of hallucinations and relevant;
      after, whether the rule predicted the action taken and again the background — r^rule = the mean of the 4.
      The calls run at ``temperature`` (official 0) and ``posthoc_temperature`` (official 0.2).
    - ``"paper"``: the paper's text, three yes/no questions ER1–ER3 (sufficient without the action; enough detail
      on its applicability; compatible with the action), r^rule = (1/3) Σ ER_i, each at ``temperature``.

    A reply that does not answer (neither yes nor no; JSON without q1 and q2 in {0, 1}; e.g. a refusal in words)
    is the model's answer: its questions score 0 (as the official code does) and it is counted in ``unparsed``
    (the first of a run logged as a warning, the rest at INFO). A backend failure is no answer: the step gets no
    rule reward (``score`` returns None, the transition is not learned from), it is counted in ``failures.total``,
    and ``max_consecutive_failures`` failed calls in a row stop the run with a one-line error
    (:class:`~flowkit.llm.chat_backends.FailureStreak`). ``null`` temperatures use the backend's own.
    """

    QUESTION_SETS = ("official", "paper")

    def __init__(self, backend: ChatBackend, questions: str = "official", temperature: float | None = 0.0,
                 posthoc_temperature: float | None = 0.2, max_consecutive_failures: int = 5):
        if questions not in self.QUESTION_SETS:
            raise ConfigError(f"LLMJudge.questions must be one of {list(self.QUESTION_SETS)}, got {questions!r}")
        check_temperature("LLMJudge.temperature", temperature)
        check_temperature("LLMJudge.posthoc_temperature", posthoc_temperature)
        self.backend = backend
        self.questions = questions
        self.temperature = temperature
        self.posthoc_temperature = posthoc_temperature
        self.failures = FailureStreak("LLMJudge", "chat backend calls", max_consecutive_failures,
                                      "LLMJudge.max_consecutive_failures")
        self.unparsed = 0

    def report(self) -> str:
        """What went wrong so far, counted (printed at the end of ``fit``)."""
        return (f"LLM judge: {self.failures.summary()} (steps without a rule reward), {self.unparsed} replies that "
                "did not answer (scored 0)")

    def _not_answered(self, reply: str) -> None:
        self.unparsed += 1
        log.log(logging.WARNING if self.unparsed == 1 else logging.INFO,
                "judge reply does not answer the question(s), scored 0 (%d so far): %.80r", self.unparsed, reply)

    def _yes(self, answer: str) -> float:
        answer = answer.strip().lower()
        word = answer.lstrip("\"'*` ").split(maxsplit=1)[0].strip(".,!:;\"'*`") if answer else ""
        if word in ("yes", "no"):
            return float(word == "yes")
        self._not_answered(answer)
        return 0.0

    def _pair(self, reply: str) -> list[float]:
        """The official reply ``{"q1": 0|1, "q2": 0|1}`` (single quotes and yes/no accepted) → two scores."""
        match = _BRACES.search(reply)
        try:
            answers = json.loads(match.group(0).replace("'", '"'))
            values = [answers["q1"], answers["q2"]]
        except (AttributeError, json.JSONDecodeError, KeyError, TypeError):
            values = []
        scores = [{1: 1.0, 0: 0.0, "yes": 1.0, "no": 0.0}.get(v.lower() if isinstance(v, str) else v) for v in values]
        if len(scores) != 2 or None in scores:
            self._not_answered(reply)
            return [0.0, 0.0]
        return scores

    def _ask(self, question: str, temperature: float | None) -> str | None:
        try:
            reply = self.backend.complete([{"role": "user", "content": question}], temperature=temperature)
        except ChatBackendError as err:
            self.failures.failed(str(err))
            return None
        self.failures.succeeded()
        return reply

    def score(self, env: LanguageEnv | PromptSnapshot, rule: Rule, decision: Decision) -> float | None:
        fields = {
            "prompt": env.prompt(), "rule": rule.rule, "background": rule.background,
            "relevance": rule.state_relevance, "action": env.valid_actions().get(decision.action, str(decision.action)),
        }
        scores = []
        if self.questions == "official":
            for question, temperature in zip(OFFICIAL_QUESTIONS, (self.temperature, self.posthoc_temperature)):
                reply = self._ask(question.format(**fields), temperature)
                if reply is None:
                    return None
                scores += self._pair(reply)
        else:
            for question in QUESTIONS:
                reply = self._ask(question.format(**fields), self.temperature)
                if reply is None:
                    return None
                scores.append(self._yes(reply))
        return sum(scores) / len(scores)
