"""The two prompts of seed 000 (§3, App. C): the explanation prompt x^e (decision withheld) and the
proxy prompt x^g(k) that asks a proxy LLM for the decision after the first k sentences.

Instruct models read them through their tokenizer's chat template (``prompt_format`` ``chat``, or ``auto``
with a tokenizer that has one): x^e is the user turn; for x^g the user turn is "Given [c], the reasoning
is [s^{1:k}]" and the assistant's answer starts "Thus, the decision is", which the candidate continues.
"""

from __future__ import annotations

from typing import Literal

from transformers import PreTrainedTokenizerBase

from flowkit.llm.chat import format_prompt

PROXY_ANSWER = "Thus, the decision is"


# x^e_j with the context at {prompt} (a data module's prompt template)
EXPLANATION_TEMPLATE = "Given {prompt}. Please analyze reasoning for the agent decision based on the context.\n"


def explanation_prompt(context: str) -> str:
    """x^e_j: "Given [c]. Please analyze reasoning for the agent decision based on the context." """
    return EXPLANATION_TEMPLATE.replace("{prompt}", context)


def proxy_prompt(context: str, reasoning: str) -> str:
    """x^g_j without the decision: "Given [c], the reasoning is [s^{1:k}]. Thus, the decision is" —
    each candidate decision is appended as " a" and scored by its mean token logit."""
    return f"Given {context}, the reasoning is {reasoning.strip()} {PROXY_ANSWER}"


def formatted_explanation_prompt(context: str, tokenizer: PreTrainedTokenizerBase,
                                 prompt_format: Literal["chat", "text"]) -> str:
    """x^e as the explanation LLM reads it (the chat template's user turn in ``chat`` format)."""
    return format_prompt(explanation_prompt(context), tokenizer, prompt_format)


def formatted_proxy_prompt(context: str, reasoning: str, tokenizer: PreTrainedTokenizerBase,
                           prompt_format: Literal["chat", "text"]) -> str:
    """x^g as a proxy reads it; in ``chat`` format the answer prefix opens the assistant turn."""
    if prompt_format == "text":
        return proxy_prompt(context, reasoning)
    question = f"Given {context}, the reasoning is {reasoning.strip()}"
    return format_prompt(question, tokenizer, "chat") + PROXY_ANSWER
