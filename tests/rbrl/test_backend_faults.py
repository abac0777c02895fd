"""A hostile or broken chat server (issue 21): every reply becomes text or the backend's own error, within a total
deadline and a size cap; a rule source or judge whose backend keeps failing stops ``flowkit fit`` with one line
(exit code 2, at most 3 stderr lines, no traceback) instead of scoring rules 0."""

import logging
import time
import tracemalloc
from email.utils import formatdate
from unittest import mock

import pytest
from loopback_chat import FAULTS, ChatModelServer
from test_llm_configs import short_run

from flowkit.llm.chat_backends import ChatBackendError, HTTPChatBackend, retry_after_seconds

MESSAGES = [{"role": "user", "content": "Is the rule compatible? Answer yes or no."}]
EXPECTED = {  # what the error names, per fault
    "non_json": "reply is not JSON", "non_utf8": "reply is not UTF-8", "short_body": "reply cut short",
    "retry_after_negative": "HTTP 429", "retry_after_nan": "HTTP 503", "null_content": "content: null",
    "huge_declared": "over max_response_bytes", "huge_chunked": "over max_response_bytes",
    "drip": "no complete reply within deadline_s = 1.5 s",
}


def _backend(server, **options) -> HTTPChatBackend:
    options = {"timeout_s": 2.0, "deadline_s": 1.5, "max_retries": 1, "backoff_s": 0.01} | options
    return HTTPChatBackend(server.base_url, "m", api_key_env="FLOWKIT_NO_KEY", **options)


@pytest.mark.parametrize("fault", FAULTS)
def test_every_fault_is_the_backends_own_error_within_the_deadline(fault):
    with ChatModelServer(fault=fault) as server:
        start = time.monotonic()
        with pytest.raises(ChatBackendError, match=EXPECTED[fault]) as err:
            _backend(server).complete(MESSAGES)
        elapsed = time.monotonic() - start
    # the total deadline (1.5 s) holds even for a body dripped a byte every 0.5 s with a 2 s read timeout
    assert elapsed < 1.5 + 0.5, elapsed
    assert str(err.value).startswith(server.base_url)
    retried = fault in ("non_json", "non_utf8", "short_body", "retry_after_negative", "retry_after_nan")
    assert len(server.requests) == (2 if retried else 1)  # garbled or cut-off replies are retried, refusals are not


def test_a_body_over_the_cap_is_never_held_whole():
    """A chunked body of up to 256 MiB: reading stops once 4 MiB (the default cap) have arrived."""
    with ChatModelServer(fault="huge_chunked") as server:
        tracemalloc.start()
        with pytest.raises(ChatBackendError, match="over max_response_bytes = 4194304"):
            _backend(server, max_retries=0, deadline_s=30.0).complete(MESSAGES)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024, peak


def test_refusal_text_is_quoted_and_not_retried():
    with ChatModelServer(fault="null_content") as server, pytest.raises(ChatBackendError) as err:
        _backend(server, max_retries=3).complete(MESSAGES)
    assert "(refusal: \"I'm sorry, but I can't help with that.\")" in str(err.value) and len(server.requests) == 1


@pytest.mark.parametrize(("header", "seconds"), [
    ("3", 3.0), ("0", 0.0), ("-5", None), ("nan", None), ("inf", None), ("soon", None), (None, None), ("1e400", None),
])
def test_retry_after_is_used_only_when_it_is_a_valid_delay(header, seconds):
    assert retry_after_seconds(header) == seconds


def test_retry_after_as_an_http_date():
    now = time.time()
    assert retry_after_seconds(formatdate(now + 20, usegmt=True), now=now) == pytest.approx(20, abs=1.5)
    assert retry_after_seconds(formatdate(now - 20, usegmt=True), now=now) == 0.0  # already past: retry at once


# ----------------------------------------------------------------------------- through `flowkit fit`


def fit_fails_in_one_line(args: list[str], capsys) -> str:
    """``flowkit fit ARGS`` in-process, logging as in a fresh process (warnings reach stderr, as the user sees
    them; under pytest its own handlers would take them): exit code 2, at most 3 stderr lines, the error last."""
    from flowkit.cli import main

    with mock.patch.object(logging.root, "handlers", []), pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    lines = err.rstrip("\n").split("\n")
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err and len(lines) <= 3, err
    assert lines[-1].startswith("error: ") and sum(line.startswith("error: ") for line in lines) == 1, err
    return lines[-1]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_rule_source_whose_backend_keeps_failing_stops_the_fit_in_one_line(fault, tmp_path, capsys):
    """Every reply is broken: the rule source warns once, counts, and stops the run after 5 failed calls in a row
    (2 for the dripped body, to keep the test short), during the warm-up, before any update."""
    limit = 2 if fault == "drip" else 5
    with ChatModelServer(fault=fault) as server:
        message = fit_fails_in_one_line(short_run(
            "rbrl_binpacking_llm.yaml", tmp_path / "run", server.base_url,
            "--data.init_args.rules.init_args.max_consecutive_failures", str(limit),
            max_retries=1, backoff_s=0.01, timeout_s=2.0, deadline_s=1.5), capsys)
    assert message.startswith(f"error: LLMRuleSource: {limit} chat backend calls in a row failed, the last: ")
    assert EXPECTED[fault] in message and server.base_url in message
    assert "raise LLMRuleSource.max_consecutive_failures" in message
    assert not list((tmp_path / "run").glob("**/*.ckpt"))


def test_a_judge_whose_backend_keeps_failing_stops_the_fit_instead_of_scoring_zero(tmp_path, capsys):
    """Rules, actions and explanations are fine; every judge reply is a refusal with no text. The rule reward is
    never a silent 0: no transition is stored without one, and 5 failed judge calls in a row stop the run."""
    with ChatModelServer(fault="null_content", fault_on="judge", malformed=0.0, refusing=0.0) as server:
        message = fit_fails_in_one_line(short_run(
            "rbrl_binpacking_llm.yaml", tmp_path / "run", server.base_url, max_retries=0), capsys)
    assert message.startswith("error: LLMJudge: 5 chat backend calls in a row failed, the last: ")
    assert "content: null" in message and "raise LLMJudge.max_consecutive_failures" in message
    assert server.kinds.count("judge") == 5  # one failed question per step: the step's other questions are not asked
