"""The two prompts of seed 000 (§3, App. C): the explanation prompt x^e (decision withheld) and the
proxy prompt x^g(k) that asks a proxy LLM for the decision after the first k sentences."""

from __future__ import annotations


def explanation_prompt(context: str) -> str:
    """x^e_j: "Given [c]. Please analyze reasoning for the agent decision based on the context." """
    return f"Given {context}. Please analyze reasoning for the agent decision based on the context.\n"


def proxy_prompt(context: str, reasoning: str) -> str:
    """x^g_j without the decision: "Given [c], the reasoning is [s^{1:k}]. Thus, the decision is" —
    each candidate decision is appended as " a" and scored by its mean token logit."""
    return f"Given {context}, the reasoning is {reasoning.strip()} Thus, the decision is"
