"""Thoughts, rules, actions and explanations written by a chat LLM (seed 002 §5.1, §5.3, Alg. 1)."""

from __future__ import annotations

import dataclasses
import json
import logging

from flowkit.errors import ConfigError
from flowkit.llm.chat_backends import ChatBackend, ChatBackendError, FailureStreak, check_temperature
from flowkit.rbrl.language import LanguageEnv, PromptSnapshot, mean_episode_returns
from flowkit.rbrl.rules import Rule, RuleParseError, parse_rules
from flowkit.rbrl.sources import RuleGenerationError, RuleSource

log = logging.getLogger(__name__)

SYSTEM = "You are a careful decision-making assistant."

THOUGHTS_PROMPT = """{prompt}

### Thoughts
Reason step by step before deciding. Write at most 5 short thoughts about: the current state; the
reward or cost at stake; how each action would change the future state; what you expect to happen next."""

RULES_PROMPT = """{prompt}
{thoughts}
### Rule generation
Write {n} different candidate rules for choosing the next action. A rule is a prioritisation statement of
the form "if/when ..., prioritise/do ...", reusable in other states, that determines the action in the
current state. The rules must differ: when the best action is uncertain, they should lead to different
actions. Reply with JSON only: a list of {n} objects, each with exactly these string fields: "background"
(why the rule makes sense for this task, thinking ahead), "rule" (the statement), "state_relevance" (how
it applies to the current state).{examples}"""

ACTION_PROMPT = """{prompt}
{thoughts}
### Selected rule
{rule}
Background: {background}
Relevance to the current state: {relevance}

### Action
Choose the action this rule leads to in the current state. Reply with JSON only: {{"action": <one of the valid action numbers>}}."""

EXPLANATION_PROMPT = """{prompt}
{thoughts}
### Selected rule
{rule}
Background: {background}

### Action taken
{action}

### Explanation
Explain to a person who cannot see your reasoning why this action was taken, in at most three short
sentences: the facts of the state you used, the rule you applied, and why it leads to this action."""


def _section(title: str, text: str) -> str:
    return f"\n### {title}\n{text}\n" if text else ""


class LLMRuleSource(RuleSource):
    """Thoughts, rule sets, rule-following actions and explanations from any :class:`ChatBackend`, in
    the order of seed 002 Alg. 1 (prompts after its Fig. 11 and the official ``agents.py``):

    1. ``generate``: the chain-of-thought for p_t (``thoughts``, default on), then ``num_rules`` rules
       written from p_t and the thoughts, with the env's example rules (``example_rules``: a list of
       JSON rule strings; default the environment's own ``example_rules``; ``[]`` for none);
    2. ``act``: the action from p_t, the thoughts and the selected rule;
    3. ``explain``: after the action was applied, its explanation from p_t, the thoughts, the rule and
       the action.

    Each call has its own sampling temperature, defaults the official ``agents.py``'s: thoughts 0.5, rules
    2.0 (diverse candidate sets), action 0.2, explanation 0.2 (``null``: the backend's own ``temperature``).

    Output that fails :func:`parse_rules` (or a backend error) is retried up to ``max_attempts`` times;
    then the state is skipped (:class:`RuleGenerationError`) and counted in ``skipped``. An action reply that
    is not a valid action is retried likewise; then ``act`` returns None (counted in ``fallback_actions``): the
    agent takes a random valid action and does not learn from that step. A failed explanation is replaced by
    a note saying so. Failed backend calls are counted (``failures.total``); the run stops with a one-line
    error once ``max_consecutive_failures`` backend calls in a row failed, or as many states in a row got no
    valid rules, or as many selected rules in a row got no valid action
    (:class:`~flowkit.llm.chat_backends.FailureStreak`); the first failure of a streak is a warning.
    """

    def __init__(
        self, backend: ChatBackend, num_rules: int = 10, thoughts: bool = True, example_rules: list[str] | None = None,
        max_attempts: int = 3, max_chars: int = 8000, thoughts_temperature: float | None = 0.5,
        rules_temperature: float | None = 2.0, action_temperature: float | None = 0.2,
        explanation_temperature: float | None = 0.2, max_consecutive_failures: int = 5,
    ):
        if num_rules < 1:
            raise ConfigError(f"LLMRuleSource.num_rules must be >= 1, got {num_rules}")
        if max_attempts < 1:
            raise ConfigError(f"LLMRuleSource.max_attempts must be >= 1, got {max_attempts}")
        self.temperatures = {"thoughts": thoughts_temperature, "rules": rules_temperature,
                             "action": action_temperature, "explanation": explanation_temperature}
        for call, value in self.temperatures.items():
            check_temperature(f"LLMRuleSource.{call}_temperature", value)
        self.backend = backend
        self.num_rules = num_rules
        self.thoughts = thoughts
        self.example_rules = None if example_rules is None else list(example_rules)
        self.max_attempts = max_attempts
        self.max_chars = max_chars
        option = "LLMRuleSource.max_consecutive_failures"
        self.failures = FailureStreak("LLMRuleSource", "chat backend calls", max_consecutive_failures, option)
        self.states_without_rules = FailureStreak("LLMRuleSource", "rule generations", max_consecutive_failures, option)
        self.actions_without_reply = FailureStreak("LLMRuleSource", "action choices", max_consecutive_failures, option)
        self.invalid_outputs = 0
        self.skipped = 0
        self.fallback_actions = 0

    def seed(self, seed: int) -> None:
        """Nothing to reset: the randomness is the backend's sampling."""

    def report(self) -> str:
        """What went wrong so far, counted (printed at the end of ``fit``)."""
        return (f"LLM rule source: {self.failures.summary()}, {self.skipped} states without valid rules "
                f"({self.invalid_outputs} invalid rule lists), {self.fallback_actions} selected rules without a valid action")

    def _ask(self, content: str, call: str) -> str:
        """One backend call for ``call`` (thoughts, rules, action, explanation) at that call's temperature."""
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
        try:
            reply = self.backend.complete(messages, temperature=self.temperatures[call])
        except ChatBackendError as err:
            self.failures.failed(f"{call}: {err}")
            raise
        self.failures.succeeded()
        return reply

    def _thoughts(self, env: LanguageEnv) -> str:
        if not self.thoughts:
            return ""
        try:
            return self._ask(THOUGHTS_PROMPT.format(prompt=env.prompt()), "thoughts").strip()
        except ChatBackendError as err:
            log.info("no thoughts for this state (%s); writing rules without them", err)
            return ""

    def generate(self, env: LanguageEnv) -> list[Rule]:
        thoughts = self._thoughts(env)
        examples = env.example_rules if self.example_rules is None else self.example_rules
        content = RULES_PROMPT.format(
            prompt=env.prompt(), thoughts=_section("Thoughts", thoughts), n=self.num_rules,
            examples=("\n\n### Example rules\n" + "\n".join(examples)) if examples else "",
        )
        reason, backend_failed = "", False
        for attempt in range(1, self.max_attempts + 1):
            try:
                rules = parse_rules(self._ask(content, "rules"), max_chars=self.max_chars, max_rules=self.num_rules)
            except (RuleParseError, ChatBackendError) as err:
                self.invalid_outputs += isinstance(err, RuleParseError)
                reason, backend_failed = str(err), isinstance(err, ChatBackendError)
                log.info("rule generation attempt %d/%d rejected: %s", attempt, self.max_attempts, reason)
                continue
            self.states_without_rules.succeeded()
            return [dataclasses.replace(rule, thoughts=thoughts) for rule in rules]
        self.skipped += 1
        self.states_without_rules.failed(
            f"no valid rules after {self.max_attempts} attempts ({self.skipped} states skipped, "
            f"{self.invalid_outputs} invalid outputs so far): {reason}",
            quiet=backend_failed,  # the backend calls' own streak has warned
        )
        raise RuleGenerationError(reason)

    def act(self, env: LanguageEnv, rule: Rule) -> int | None:
        valid = env.valid_actions()
        content = ACTION_PROMPT.format(
            prompt=env.prompt(), thoughts=_section("Thoughts", rule.thoughts), rule=rule.rule,
            background=rule.background, relevance=rule.state_relevance,
        )
        action = self._valid_action(content, valid)
        if action is None:
            self.fallback_actions += 1
            self.actions_without_reply.failed(
                f"no valid action for the selected rule after {self.max_attempts} attempts ({self.fallback_actions} "
                "so far; a random valid action is taken and not learned from)"
            )
        else:
            self.actions_without_reply.succeeded()
        return action

    def _valid_action(self, content: str, valid: dict[int, str]) -> int | None:
        """Ask up to ``max_attempts`` times for ``{"action": n}`` with n a valid action; None if never."""
        for _ in range(self.max_attempts):
            try:
                reply = json.loads(self._ask(content, "action").strip().removeprefix("```json").removesuffix("```"))
                action = int(reply["action"])
            except (ChatBackendError, json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            if action in valid:
                return action
        return None

    def explain(self, before: PromptSnapshot, rule: Rule, action: int) -> str:
        content = EXPLANATION_PROMPT.format(
            prompt=before.prompt(), thoughts=_section("Thoughts", rule.thoughts), rule=rule.rule,
            background=rule.background, action=before.valid_actions().get(action, str(action)),
        )
        try:
            return self._ask(content, "explanation").strip()
        except ChatBackendError as err:
            return f"(no explanation: {err})"


COT_ACTION_PROMPT = """{prompt}
{thoughts}
### Action
Choose the optimal action given your thoughts and the current state. Reply with JSON only: {{"action": <one of the valid action numbers>}}."""

COT_EXPLANATION_PROMPT = """{prompt}
{thoughts}
### Action taken
{action}

### Explanation
Explain to a person who cannot see your reasoning why this action was taken, in at most three short
sentences: the facts of the state you used and why they lead to this action."""


class CoTLLMAgent:
    """The chain-of-thought LLM agent baseline of seed 002 §7 (the official ``BaseAgent``): per step the
    thoughts for p_t, the action from p_t and the thoughts (no rules, no selector), the environment step,
    then the explanation of the applied action, at the rule source's per-call temperatures. Invalid action
    replies are retried ``max_attempts`` times, then the first valid action is taken and counted in
    ``fallback_actions``; backend calls failing ``max_consecutive_failures`` times in a row stop the run."""

    def __init__(self, backend: ChatBackend, max_attempts: int = 3, max_consecutive_failures: int = 5):
        if max_attempts < 1:
            raise ConfigError(f"CoTLLMAgent.max_attempts must be >= 1, got {max_attempts}")
        self.source = LLMRuleSource(backend, num_rules=1, thoughts=True, max_attempts=max_attempts,
                                    max_consecutive_failures=max_consecutive_failures)
        self.fallback_actions = 0

    def step(self, env: LanguageEnv) -> tuple[float, bool, str]:
        """One step: (environment reward, done, explanation)."""
        source = self.source
        before = env.snapshot()
        thoughts = _section("Thoughts", source._thoughts(env))
        valid = before.valid_actions()
        action = source._valid_action(COT_ACTION_PROMPT.format(prompt=before.prompt(), thoughts=thoughts), valid)
        if action is None:
            self.fallback_actions += 1
            action = min(valid)
        _, reward, terminated, truncated, _ = env.step(action)
        try:
            explanation = source._ask(COT_EXPLANATION_PROMPT.format(prompt=before.prompt(), thoughts=thoughts, action=valid[action]),
                                      "explanation").strip()
        except ChatBackendError as err:
            explanation = f"(no explanation: {err})"
        return float(reward), terminated or truncated, explanation

    def evaluate(self, env: LanguageEnv, seeds: list[int], episodes: int) -> list[float]:
        """Mean episode return per evaluation seed, episode seeds ``1000·seed + k`` as the rule agents'."""
        return mean_episode_returns(env, lambda env: self.step(env)[:2], seeds, episodes).tolist()
