"""The HTTP backend against a real OpenAI-compatible server on loopback; the HF backend on a tiny model."""

import json
import logging
import time
from http.server import BaseHTTPRequestHandler

import pytest
from loopback_server import ScriptedServer, reply

from flowkit.llm.chat_backends import ChatBackendError, HFChatBackend, HTTPChatBackend

SECRET = "sk-test-very-secret-0123456789"


MESSAGES = [{"role": "user", "content": "hi"}]


def _backend(server, **kw) -> HTTPChatBackend:
    kw = {"api_key_env": "FLOWKIT_TEST_KEY", "timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.01} | kw
    return HTTPChatBackend(server.base_url, "test-model", **kw)


def test_success_sends_key_from_env_and_openai_body(monkeypatch, caplog):
    monkeypatch.setenv("FLOWKIT_TEST_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    with ScriptedServer([(200, reply("hello"), 0.0)]) as server:
        assert _backend(server).complete(MESSAGES) == "hello"
    request = server.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == f"Bearer {SECRET}"
    assert request["body"]["model"] == "test-model" and request["body"]["messages"] == MESSAGES
    assert SECRET not in caplog.text


def test_no_key_no_authorization_header(monkeypatch):
    monkeypatch.delenv("FLOWKIT_TEST_KEY", raising=False)
    with ScriptedServer([(200, reply("ok"), 0.0)]) as server:
        _backend(server).complete(MESSAGES)
    assert server.requests[0]["auth"] is None


def test_429_and_500_are_retried_with_backoff_then_succeed(monkeypatch, caplog):
    monkeypatch.setenv("FLOWKIT_TEST_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    script = [(429, {"error": "slow down"}, 0.0), (500, {"error": "boom"}, 0.0), (200, reply("finally"), 0.0)]
    with ScriptedServer(script) as server:
        assert _backend(server).complete(MESSAGES) == "finally"
    assert len(server.requests) == 3
    assert "HTTP 429" in caplog.text and "HTTP 500" in caplog.text and "retry 2/2" in caplog.text
    assert SECRET not in caplog.text


def test_retries_are_bounded_and_error_hides_key(monkeypatch, caplog):
    monkeypatch.setenv("FLOWKIT_TEST_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    with ScriptedServer([(500, {"error": SECRET}, 0.0)]) as server, \
            pytest.raises(ChatBackendError, match="gave up after 3 attempts") as err:
        _backend(server).complete(MESSAGES)
    assert len(server.requests) == 3
    assert SECRET not in str(err.value) and SECRET not in caplog.text


def test_client_errors_are_not_retried(monkeypatch):
    monkeypatch.setenv("FLOWKIT_TEST_KEY", SECRET)
    with ScriptedServer([(401, {"error": "bad key"}, 0.0)]) as server, \
            pytest.raises(ChatBackendError, match="HTTP 401") as err:
        _backend(server).complete(MESSAGES)
    assert len(server.requests) == 1 and SECRET not in str(err.value)


def test_timeouts_are_retried_then_fail(monkeypatch, caplog):
    monkeypatch.setenv("FLOWKIT_TEST_KEY", SECRET)
    with ScriptedServer([(200, reply("too late"), 1.0)]) as server:
        start = time.monotonic()
        with pytest.raises(ChatBackendError, match="timed out after 0.2 s"):
            _backend(server, timeout_s=0.2, max_retries=1).complete(MESSAGES)
        elapsed = time.monotonic() - start
    assert len(server.requests) == 2 and elapsed < 1.5  # two 0.2 s attempts, not two full 1 s answers
    assert SECRET not in caplog.text


def test_malformed_response_is_an_error(monkeypatch):
    with ScriptedServer([(200, {"unexpected": True}, 0.0)]) as server, pytest.raises(ChatBackendError, match="no choices"):
        _backend(server).complete(MESSAGES)


def test_hf_backend_generates_from_a_saved_tiny_model(tmp_path):
    from flowkit.llm.tiny import char_tokenizer, tiny_qwen2

    tokenizer = char_tokenizer("abcdefghijklmnopqrstuvwxyz :{}[]\",.0123456789\n")
    model = tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, max_positions=4096)
    model.save_pretrained(tmp_path / "plain")
    tokenizer.save_pretrained(tmp_path / "plain")
    backend = HFChatBackend(str(tmp_path / "plain"), max_new_tokens=6, temperature=1.0)
    text = backend.complete([{"role": "user", "content": "write rules as json"}])
    assert isinstance(text, str) and 0 < len(text) <= 6  # one character per token

    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    model.save_pretrained(tmp_path / "chat")
    tokenizer.save_pretrained(tmp_path / "chat")
    backend = HFChatBackend(str(tmp_path / "chat"), max_new_tokens=4, temperature=0.0)
    assert backend.tokenizer.chat_template and len(backend.complete([{"role": "user", "content": "hi"}])) <= 4
    # per-call settings: greedy at temperature 0 repeats itself; max_tokens overrides max_new_tokens
    hi = [{"role": "user", "content": "hi"}]
    assert backend.complete(hi, temperature=0.0, max_tokens=12) == backend.complete(hi, temperature=0.0, max_tokens=12)
    assert len(backend.complete(hi, max_tokens=2)) <= 2
    # a rule source and a judge configured with the same model share one loaded copy
    assert HFChatBackend(str(tmp_path / "chat"), temperature=2.0).model is backend.model


class RedirectingServer(ScriptedServer):
    """Answers every POST with ``status`` and ``Location: location``; records the requests it saw."""

    def __init__(self, status: int, location: str):
        super().__init__([(200, reply("unused"), 0.0)])
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.requests.append({"path": self.path, "auth": self.headers.get("Authorization")})
                self.send_response(status)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd.server_close()  # the scripted server's, replaced by this handler's
        self._serve(Handler)


class AnyMethodServer(ScriptedServer):
    """Records the Authorization header of any GET or POST (a followed 302 turns the POST into a GET)."""

    def __init__(self):
        super().__init__([(200, reply("leaked"), 0.0)])
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                server.requests.append({"path": self.path, "auth": self.headers.get("Authorization")})
                data = json.dumps(reply("leaked")).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.httpd.server_close()  # the scripted server's, replaced by this handler's
        self._serve(Handler)


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_redirect_to_another_origin_never_receives_the_key(monkeypatch, status):
    # 127.0.0.1 on two ports = two origins; the second must never see the Authorization header
    monkeypatch.setenv("FLOWKIT_TEST_KEY", SECRET)
    with AnyMethodServer() as target:
        with RedirectingServer(status, target.base_url + "/chat/completions") as first:
            with pytest.raises(ChatBackendError, match=f"HTTP {status} redirect not followed") as err:
                _backend(first).complete(MESSAGES)
    assert len(first.requests) == 1 and first.requests[0]["auth"] == f"Bearer {SECRET}"
    assert target.requests == []  # nothing at all reached the other origin, so no header either
    assert SECRET not in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_url": "127.0.0.1:8000/v1"}, "HTTPChatBackend.base_url must start with http"),
        ({"timeout_s": 0.0}, "HTTPChatBackend.timeout_s must be a finite value > 0"),
        ({"deadline_s": float("inf")}, "HTTPChatBackend.deadline_s must be a finite value > 0"),
        ({"max_response_bytes": 10}, "HTTPChatBackend.max_response_bytes must be >= 1024"),
        ({"temperature": -0.5}, "HTTPChatBackend.temperature must be a finite value >= 0"),
        ({"max_retries": -1}, "HTTPChatBackend.max_retries must be >= 0"),
        ({"max_tokens": 0}, "HTTPChatBackend.max_tokens must be >= 1"),
    ],
)
def test_http_backend_rejects_bad_options_at_construction(kwargs, message):
    from flowkit.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        HTTPChatBackend(**({"base_url": "http://127.0.0.1:1/v1", "model": "m"} | kwargs))
