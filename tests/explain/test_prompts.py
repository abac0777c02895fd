import copy

import pytest

from flowkit.explain.prompts import (
    PROXY_ANSWER,
    explanation_prompt,
    formatted_explanation_prompt,
    formatted_proxy_prompt,
    proxy_prompt,
)
from flowkit.llm.chat import resolve_prompt_format

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture()
def instruct_tokenizer(tokenizer):
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = TEMPLATE
    return chat


def test_plain_tokenizers_get_the_papers_text_prompts(tokenizer):
    assert resolve_prompt_format("auto", tokenizer) == "text"
    assert formatted_explanation_prompt("d=+1,+2", tokenizer, "text") == explanation_prompt("d=+1,+2")
    assert formatted_proxy_prompt("d=+1,+2", "x gap.", tokenizer, "text") == proxy_prompt("d=+1,+2", "x gap.")


def test_instruct_tokenizers_get_their_chat_template_with_the_answer_prefix_in_the_assistant_turn(instruct_tokenizer):
    assert resolve_prompt_format("auto", instruct_tokenizer) == "chat"
    assert formatted_explanation_prompt("d=+1,+2", instruct_tokenizer, "chat") == \
        f"[user]{explanation_prompt('d=+1,+2')}\n[assistant]"
    assert formatted_proxy_prompt("d=+1,+2", " x gap. ", instruct_tokenizer, "chat") == \
        f"[user]Given d=+1,+2, the reasoning is x gap.\n[assistant]{PROXY_ANSWER}"
