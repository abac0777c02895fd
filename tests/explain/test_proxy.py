import pytest
import torch

from flowkit.explain.prompts import proxy_prompt
from flowkit.explain.proxy import decision_logits, rejection_mask
from flowkit.explain.tokenizer import word_tokenizer


def test_proxy_logits_equal_manual_per_decision_computation_in_one_forward(backbone, tokenizer, decisions):
    prompts = [proxy_prompt("d=+1,+2 a=?", "y gap is larger."), proxy_prompt("d=-3,+0 a=?", "goal is 3 west.")]
    calls = []
    handle = backbone.register_forward_hook(lambda *_: calls.append(1))
    try:
        got = decision_logits(backbone, tokenizer, prompts, decisions)
    finally:
        handle.remove()
    assert len(calls) == 1 and got.shape == (2, 4)
    for i, prompt in enumerate(prompts):
        prompt_ids = tokenizer(prompt)["input_ids"]
        for j, decision in enumerate(decisions):
            candidate = tokenizer(" " + decision, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = backbone(torch.tensor([prompt_ids + candidate])).logits[0]
            manual = torch.stack([logits[len(prompt_ids) + k - 1, tok] for k, tok in enumerate(candidate)]).mean()
            torch.testing.assert_close(got[i, j], manual, atol=1e-5, rtol=1e-5)


def test_rows_split_across_forwards_keep_examples_whole(backbone, tokenizer, decisions):
    prompts = [proxy_prompt(f"d=+{i},+1 a=?", "x gap is larger.") for i in range(3)]
    whole = decision_logits(backbone, tokenizer, prompts, decisions)
    calls = []
    handle = backbone.register_forward_hook(lambda *_: calls.append(1))
    try:
        split = decision_logits(backbone, tokenizer, prompts, decisions, max_rows=5)  # 4 candidates per forward
    finally:
        handle.remove()
    assert len(calls) == 3
    torch.testing.assert_close(whole, split, atol=1e-5, rtol=1e-5)


def test_rejection_keeps_argmax_equal_to_true_decision():
    logits = torch.tensor([[0.1, 2.0, 0.0], [3.0, 1.0, 0.0]])
    assert rejection_mask(logits, torch.tensor([1, 1])).tolist() == [True, False]


def test_a_decision_without_tokens_is_an_error(backbone):
    words = word_tokenizer(["Given x a"])  # drops whitespace, so the empty decision has no tokens
    with pytest.raises(ValueError, match="no tokens"):
        decision_logits(backbone, words, ["Given x"], ["a", ""])
