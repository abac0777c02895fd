import json
import random
import threading
import time

import pytest

from flowkit.data.grader import extract_boxed, grade, is_absurd, is_equivalent, outcome_reward
from flowkit.data.math_verify_worker import equivalent as math_verify_equivalent
from flowkit.llm.backbone import ASSETS

HANG_BOUND_S = 5.0  # generous: only catches hangs, the verdicts are what is asserted


@pytest.fixture
def math_eval_answers():
    paths = sorted((ASSETS / "math_eval").glob("*.jsonl"))  # the bundled MATH500, AMC23, AIME24, AIME25
    answers = [json.loads(line)["answer"] for path in paths for line in path.read_text().splitlines() if line.strip()]
    assert len(answers) == 500 + 83 + 30 + 30
    return answers


@pytest.mark.parametrize("text, boxed", [
    ("so \\boxed{85}", "85"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),             # last box wins
    ("\\boxed{\\left\\{ 1, 2 \\right\\}}", "\\left\\{ 1, 2 \\right\\}"),  # escaped braces do not count
    ("\\boxed {x^{2}}", "x^{2}"),
    ("\\boxed{1} and \\boxed{2", None),                                     # unclosed last box
    ("no box", None),
    ("\\boxed 5", None),
])
def test_extract_boxed(text, boxed):
    assert extract_boxed(text) == boxed


def test_every_math_eval_answer_grades_correct_against_itself(math_eval_answers):
    for answer in math_eval_answers:
        assert grade(f"The answer is $\\boxed{{{answer}}}$.", answer), answer
        assert outcome_reward(f"\\boxed{{ {answer} }}", answer, "binary") == 1.0


def test_math_verify_agrees_on_a_sample_of_math_eval_answers(math_eval_answers):
    """The string fast path decides self-grading above; this runs a sample through math-verify itself."""
    for answer in random.Random(0).sample(math_eval_answers, 40):
        assert math_verify_equivalent(answer, answer), answer


@pytest.mark.parametrize("pred, ref", [
    ("0.5", "\\frac{1}{2}"),
    ("\\dfrac{1}{2}", "\\frac12"),
    ("\\tfrac{3}{4}", "0.75"),
    ("p-q", "p - q"),
    ("(3,\\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("10,\\!080", "10080"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("85.0", "85"),
])
def test_equal_forms_grade_correct(pred, ref):
    assert is_equivalent(pred, ref, timeout_s=30.0)  # generous: a loaded CI machine must not flip the verdict


@pytest.mark.parametrize("pred, ref", [
    ("84", "85"),
    ("\\frac{1}{3}", "0.5"),
    ("p+q", "p - q"),
    ("(3,\\pi)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("", "1"),
])
def test_different_answers_grade_wrong(pred, ref):
    assert not is_equivalent(pred, ref, timeout_s=30.0)


@pytest.mark.parametrize("response", [
    "\\boxed{10^{10^{10^{10}}}}",
    "\\boxed{10^10^10^10}",
    "\\boxed{9^{999999999}}",
    "\\boxed{100000!}",
    "\\boxed{" + "9" * 100_000 + "}",
    "\\boxed{" + "{" * 50_000 + "1" + "}" * 50_000 + "}",
    "\\boxed{" + "{" * 100_000,
    "\\boxed{",
    "x" * 100_000,
])
def test_adversarial_outputs_grade_wrong_without_hanging(response):
    started = time.monotonic()
    assert not grade(response, "5")
    assert time.monotonic() - started < HANG_BOUND_S


def test_is_absurd_spares_ordinary_answers(math_eval_answers):
    assert not any(is_absurd(answer) for answer in math_eval_answers)
    assert is_absurd("2^{2^{2}}") and is_absurd("10^10^10") and not is_absurd("e^{-x^2}")


def test_overrunning_comparison_times_out_and_worker_recovers():
    # The letters let this tower pass the cheap guard; sympy cancels x - x and then evaluates
    # 10^(10^(10^10)) in C, which never returns (checked by hand) and only a kill can stop.
    started = time.monotonic()
    assert not is_equivalent("10^{10^{10^{10}}+x-x}", "1", timeout_s=0.5)
    assert time.monotonic() - started < HANG_BOUND_S
    assert is_equivalent("0.5", "\\frac{1}{2}", timeout_s=30.0)


def test_works_off_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(is_equivalent("0.25", "\\frac{1}{4}", timeout_s=30.0)))
    thread.start()
    thread.join()
    assert results == [True]


@pytest.mark.parametrize("response, official, binary", [
    ("7+8=15,4+3+1=8\\boxed{85}", 1.0, 1.0),
    ("7+8=15,4+3+1=9\\boxed{95}", 0.5, 0.0),
    ("7+8=15,4+3+1=8", 0.0, 0.0),
    ("\\boxed{85", 0.0, 0.0),
])
def test_outcome_reward_schemes(response, official, binary):
    assert outcome_reward(response, "85", "official") == official
    assert outcome_reward(response, "85", "binary") == binary


def test_outcome_reward_rejects_unknown_scheme():
    with pytest.raises(ValueError, match="scheme"):
        outcome_reward("\\boxed{1}", "1", "partial")

