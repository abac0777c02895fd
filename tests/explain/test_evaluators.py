"""Judges of explanation accuracy: the local logit evaluator on a bundled proxy, the generative evaluator against
an OpenAI-compatible server on loopback, and the accuracy both feed."""

import json
import logging

import pytest
import torch
from loopback_server import ScriptedServer, reply

from flowkit.errors import ConfigError
from flowkit.explain.evaluators import (
    GenerativeEvaluator,
    LogitEvaluator,
    explanation_accuracy,
    judge_question,
    parse_decision,
)
from flowkit.explain.gridworld import DECISIONS
from flowkit.explain.proxy import proxy_probabilities
from flowkit.llm.backbone import load_backbone
from flowkit.modules.datamodule import resolve_data_path
from flowkit.llm.chat_backends import ChatBackendUnavailable, HTTPChatBackend

CONTEXT = "d=+0,+2 a=north; d=+0,+1 a=?"
EXPLANATION = "goal is 0 east, 1 north. y gap is larger."
NORTH, SOUTH, EAST, WEST = range(4)


class Fixed:
    """An evaluator that answers given rows, for the accuracy's arithmetic."""

    def __init__(self, rows):
        self.rows = torch.tensor(rows)

    def probabilities(self, contexts, explanations, decisions):
        return self.rows


def test_accuracy_needs_the_true_decision_to_be_the_single_most_probable():
    uniform, one_hot_north = [0.25] * 4, [1.0, 0.0, 0.0, 0.0]
    target = torch.tensor([NORTH, NORTH, SOUTH])
    judges = [Fixed([uniform, one_hot_north, [0.1, 0.6, 0.2, 0.1]]),
              Fixed([one_hot_north, uniform, [0.4, 0.4, 0.1, 0.1]])]
    got = explanation_accuracy(judges, ["c"] * 3, ["e"] * 3, list(DECISIONS), target)
    # Row 0: argmax of the uniform row is north, the true decision, yet "no decision" is not a right judgement.
    assert got.tolist() == [0.5, 0.5, 0.5]


def test_logit_evaluator_is_the_proxy_probabilities_of_its_model():
    model, tokenizer = load_backbone("bundled:explain_tiny/proxy2")
    with resolve_data_path("bundled:gridworld/test.jsonl").open() as f:
        records = [json.loads(line) for line, _ in zip(f, range(32), strict=False)]
    contexts, preferred = [r["context"] for r in records], [r["preferred"] for r in records]
    evaluator = LogitEvaluator(model, tokenizer)  # auto: the word tokenizer has no chat template → text
    assert evaluator.prompt_format == "text"
    got = evaluator.probabilities(contexts, preferred, list(DECISIONS))
    expected = proxy_probabilities([(model, tokenizer)], contexts, preferred, [r["decisions"] for r in records])[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    per_row = evaluator.probabilities(contexts, preferred, [r["decisions"] for r in records])
    torch.testing.assert_close(per_row, got, rtol=0, atol=0)
    target = torch.tensor([DECISIONS.index(r["decision"]) for r in records])
    # The clean proxy reads the informative explanations (model card: 0.99 on the whole test split).
    assert explanation_accuracy([evaluator], contexts, preferred, list(DECISIONS), target).mean() >= 0.9


def test_bundled_noisy_proxies_are_each_worse_than_their_mean():
    """explain_noisy's model card on the 96 test contexts the toy config holds out: each proxy misreads one
    decision (about a quarter of the records), the mean of the three does not."""
    with resolve_data_path("bundled:gridworld/test.jsonl").open() as f:
        records = [json.loads(line) for line, _ in zip(f, range(96), strict=False)]
    contexts, preferred = [r["context"] for r in records], [r["preferred"] for r in records]
    target = torch.tensor([DECISIONS.index(r["decision"]) for r in records])
    probs = torch.stack([LogitEvaluator(*load_backbone(f"bundled:explain_noisy/proxy{k}")).probabilities(
        contexts, preferred, list(DECISIONS)) for k in range(3)])
    single = (probs.argmax(-1) == target).float().mean(-1)
    assert (single < 0.8).all(), single
    assert (probs.mean(0).argmax(-1) == target).float().mean() >= 0.95


def test_judge_question_lists_the_numbered_candidates():
    assert judge_question(CONTEXT, EXPLANATION + " ", DECISIONS) == (
        "Given d=+0,+2 a=north; d=+0,+1 a=?, the reasoning is goal is 0 east, 1 north. y gap is larger. "
        "Thus, the decision is one of:\n1. north\n2. south\n3. east\n4. west\n"
        "Which decision does this reasoning imply? Answer with the number of that decision only."
    )
    assert "the reasoning is it moved before. Thus" in judge_question(CONTEXT, "it moved before", DECISIONS)


@pytest.mark.parametrize("text, expected", [
    ("1", NORTH), ("1.", NORTH), ("(2)", SOUTH), ("**3**", EAST), ("4. west", WEST), ("2 (south)", SOUTH),
    ("2) South", SOUTH), ("East.", EAST), ('"west"', WEST), ("Answer: 3", EAST), ("Decision: north", NORTH),
    ("The decision is 2 (south).", SOUTH), ("  4\n", WEST),
    ("2. north", None), ("1 or 2", None), ("2, 3", None), ("north or south", None), ("5", None), ("0", None),
    ("-2", None), ("two", None), ("", None), ("I'm sorry, but I can't help with that.", None),
    ("The decision is south because the y gap is larger.", None),
])
def test_parser_accepts_one_named_decision_only(text, expected):
    assert parse_decision(text, DECISIONS) == expected


def test_parser_with_numeric_labels_takes_a_label_and_refuses_a_reply_that_is_two_candidates():
    assert parse_decision("12", ["12", "15", "18"]) == 0  # a label, not the (absent) 12th candidate
    assert parse_decision("2", ["2", "3", "1"]) is None  # candidate 2 is "3", label "2" is candidate 1


def _backend(server, **kw):
    kw = {"api_key_env": "FLOWKIT_TEST_KEY", "timeout_s": 2.0, "max_retries": 1, "backoff_s": 0.01} | kw
    return HTTPChatBackend(server.base_url, "judge-model", **kw)


def test_generative_evaluator_is_one_hot_on_the_named_decision_and_asks_the_judge_question():
    script = [(200, reply(text), 0.0) for text in ("1", "The decision is 4 (west).", "East")]
    with ScriptedServer(script) as server:
        evaluator = GenerativeEvaluator(_backend(server))
        probs = evaluator.probabilities([CONTEXT, "c1", "c2"], [EXPLANATION, "e1.", "e2."], list(DECISIONS))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]]
    first = server.requests[0]["body"]
    assert first["model"] == "judge-model" and first["temperature"] == 0.0 and first["max_tokens"] == 16
    assert first["messages"] == [{"role": "user", "content": judge_question(CONTEXT, EXPLANATION, DECISIONS)}]
    assert [r["body"]["messages"][0]["content"].split(", the reasoning is")[0] for r in server.requests] == [
        f"Given {CONTEXT}", "Given c1", "Given c2"]
    assert evaluator.undecided == 0 and evaluator.failures.total == 0


def test_replies_naming_no_single_decision_are_uniform_counted_and_warned_once(caplog):
    texts = ["I'm sorry, but I can't help with that.", "1 or 2", "2. north", "south, probably", "Sure! 2"]
    with ScriptedServer([(200, reply(t), 0.0) for t in texts] + [(200, reply("2"), 0.0)]) as server:
        evaluator = GenerativeEvaluator(_backend(server))
        with caplog.at_level(logging.INFO, logger="flowkit.explain.evaluators"):
            probs = evaluator.probabilities(["c"] * 6, ["e"] * 6, list(DECISIONS))
    assert probs[:5].eq(0.25).all() and probs[5].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert evaluator.undecided == 5 and evaluator.failures.total == 0
    records = [r for r in caplog.records if r.name == "flowkit.explain.evaluators"]
    assert [r.levelno for r in records] == [logging.WARNING] + [logging.INFO] * 4
    assert "no single decision" in records[0].getMessage() and "sorry" in records[0].getMessage()
    assert "5 replies that named no single decision" in evaluator.report()
    target = torch.full((6,), SOUTH)
    rows = Fixed(probs.tolist())
    assert explanation_accuracy([rows], ["c"] * 6, ["e"] * 6, list(DECISIONS), target).tolist() == [0.0] * 5 + [1.0]


def test_backend_failures_are_uniform_rows_counted_by_the_streak_and_stop_the_run_in_a_row():
    null_refusal = {"choices": [{"message": {"role": "assistant", "content": None, "refusal": "no"}}]}
    script = [
        (500, {"error": "busy"}, 0.0), (200, reply("3"), 0.0),  # retried inside the backend: one good row
        (404, {"error": "no such model"}, 0.0),  # fails at once: a failure, uniform row
        (200, null_refusal, 0.0),  # content null: a failure, not a reply
        (200, reply("1"), 0.0),  # success ends the streak
        (404, {"error": "gone"}, 0.0),
    ]
    with ScriptedServer(script) as server:
        evaluator = GenerativeEvaluator(_backend(server), max_consecutive_failures=3)
        probs = evaluator.probabilities(["c"] * 4, ["e"] * 4, list(DECISIONS))
        assert probs.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.25] * 4, [0.25] * 4, [1.0, 0.0, 0.0, 0.0]]
        assert evaluator.failures.total == 2 and evaluator.failures.in_a_row == 0 and evaluator.undecided == 0
        with pytest.raises(ChatBackendUnavailable, match="GenerativeEvaluator: 3 chat backend calls in a row failed"):
            evaluator.probabilities(["c"] * 4, ["e"] * 4, list(DECISIONS))  # the last entry (404) repeats
    assert evaluator.failures.total == 5


def test_options_and_inputs_are_checked():
    backend = HTTPChatBackend("http://127.0.0.1:9/v1", "m")
    with pytest.raises(ConfigError, match="temperature"):
        GenerativeEvaluator(backend, temperature=-1.0)
    with pytest.raises(ConfigError, match="max_tokens"):
        GenerativeEvaluator(backend, max_tokens=0)
    with pytest.raises(ConfigError, match="max_consecutive_failures"):
        GenerativeEvaluator(backend, max_consecutive_failures=0)
    with pytest.raises(ValueError, match="same, nonzero number"):
        GenerativeEvaluator(backend).probabilities(["a", "b"], ["x", "y"], [["n", "s"], ["n"]])
    with pytest.raises(ValueError, match="2 rows but 1 candidate lists"):
        GenerativeEvaluator(backend).probabilities(["a", "b"], ["x", "y"], [["n", "s"]])
