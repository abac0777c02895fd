"""Where rules, actions and explanations come from (seed 002 Alg. 1 lines 3, 5 and 7), behind one interface."""

from __future__ import annotations

from dataclasses import dataclass

from flowkit.rbrl.language import LanguageEnv, PromptSnapshot
from flowkit.rbrl.rules import Rule


@dataclass(frozen=True)
class Decision:
    """The environment action taken under a rule and the explanation given for it (Alg. 1 lines 5, 7)."""

    action: int
    explanation: str


class RuleGenerationError(RuntimeError):
    """No valid rule set could be obtained for a state (after the source's retries)."""


class RuleSource:
    """Base class: subclasses are chosen in the config by ``class_path``."""

    def seed(self, seed: int) -> None:
        """Reset the source's own randomness (rule order, sampling) for reproducible episodes."""
        raise NotImplementedError

    def generate(self, env: LanguageEnv) -> list[Rule]:
        """Candidate rules R_t for the env's current state; raises :class:`RuleGenerationError`."""
        raise NotImplementedError

    def act(self, env: LanguageEnv, rule: Rule) -> int | None:
        """The valid action the selected rule leads to in the current state (Alg. 1 line 5); None when the
        source could not tell (the agent then takes a random valid action and the step is not learned from)."""
        raise NotImplementedError

    def explain(self, before: PromptSnapshot, rule: Rule, action: int) -> str:
        """The explanation of ``action``, written after it was applied (Alg. 1 line 7) about the state
        ``before`` it, in which the rule was selected."""
        raise NotImplementedError
