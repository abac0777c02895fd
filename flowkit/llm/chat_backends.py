"""Chat LLM backends — RBRL's rule generation, actions and judging, and the explanation reward's judges: an
OpenAI-compatible HTTP endpoint (vLLM, llama.cpp server, a hosted API, ...) or a local Hugging Face chat model; and
:class:`FailureStreak`, which stops a run whose backend keeps failing."""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import math
import os
import random
import time
import urllib.error
import urllib.request
from datetime import timezone
from functools import lru_cache

from flowkit.errors import ConfigError

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]


class ChatBackendError(RuntimeError):
    """The backend gave no completion (after its retries)."""


class ChatBackendUnavailable(ConfigError):
    """A judge's or rule source's backend failed too many calls in a row (or its replies never parsed): the run
    stops, and the ``flowkit`` CLI prints this as its one-line error. A ConfigError because the fix is in the
    configuration the user gave — the backend's address, model or server — not in flowkit."""


class FailureStreak:
    """Consecutive failures of one kind for one user of a backend (e.g. ``LLMJudge``'s backend calls).

    ``failed`` counts a failure (``total`` counts them all), logs the run's first one as a warning and the rest at
    INFO (a dead server is one warning line and then the error, an occasional refusal in a long run one warning in
    all) and raises :class:`ChatBackendUnavailable` once ``limit`` failures came in a row; ``succeeded`` ends the
    streak. ``summary()`` is the count for the end-of-run report.
    """

    def __init__(self, owner: str, what: str, limit: int, option: str):
        if limit < 1:
            raise ConfigError(f"{option} must be >= 1, got {limit}")
        self.owner, self.what, self.limit, self.option = owner, what, limit, option
        self.in_a_row = 0
        self.total = 0

    def failed(self, reason: str, quiet: bool = False) -> None:
        """Count a failure; ``quiet``: log it at INFO even if it is the first (another streak warned already)."""
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.limit:
            raise ChatBackendUnavailable(
                f"{self.owner}: {self.limit} {self.what} in a row failed, the last: {reason}; stopping the run "
                f"(check the backend's base_url / model and its server, or raise {self.option})"
            )
        level = logging.WARNING if self.total == 1 and not quiet else logging.INFO
        log.log(level, "%s: %s failed (%d in a row, %d in all; the run stops at %d in a row, later failures are "
                "counted and logged at INFO): %s", self.owner, self.what.removesuffix("s"), self.in_a_row, self.total,
                self.limit, reason)

    def summary(self) -> str:
        return f"{self.total} failed {self.what}"

    def succeeded(self) -> None:
        if self.in_a_row:
            log.info("%s: %s succeed again after %d failures", self.owner, self.what, self.in_a_row)
        self.in_a_row = 0


class ChatBackend:
    """Base class: ``complete(messages, temperature, max_tokens) -> text`` (None: the backend's own setting);
    subclasses are chosen in the config by ``class_path``."""

    def complete(self, messages: Messages, temperature: float | None = None, max_tokens: int | None = None) -> str:
        raise NotImplementedError


def check_temperature(option: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{option} must be a finite value >= 0, got {value}")


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: urllib would re-send every header, the Authorization bearer key
    included, to whatever host the Location names (and turn the POST into a body-less GET)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # the 30x then surfaces as an HTTPError


class _Retry(Exception):
    """A failed attempt worth repeating (transport fault, busy server, reply cut short or garbled)."""

    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.retry_after = retry_after


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A Retry-After header in seconds: a number (finite, >= 0) or an HTTP date; None when absent or
    unusable (``-5``, ``nan``, ``inf``, garbage): the backend's own backoff applies then."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = when.timestamp() - (time.time() if now is None else now)
        return max(seconds, 0.0)
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _socket_of(response):
    """The socket under an ``http.client.HTTPResponse`` (through its buffered reader), so each read can wait
    at most until the deadline; None where that layout differs (reads then wait up to ``timeout_s``)."""
    return getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)


class HTTPChatBackend(ChatBackend):
    """POST ``{base_url}/chat/completions`` (OpenAI-compatible).

    The API key is read from the environment variable named ``api_key_env`` at each call (never from the
    config, never logged); when unset no Authorization header is sent, as local servers expect.
    The key goes to ``base_url`` only: a 3xx redirect is never followed (it fails at once, naming the
    status), so credentials cannot be forwarded to another host; point ``base_url`` at the final address.

    Every call ends, within ``deadline_s`` in all (connecting, waiting, reading, retries and their pauses),
    with the reply's text or a :class:`ChatBackendError` saying why: ``timeout_s`` bounds each wait for the
    server, ``deadline_s`` the whole call (a body dripped byte by byte is cut off), and a reply over
    ``max_response_bytes`` is refused unread (from its Content-Length) or as soon as it grows past the cap.
    Timeouts, connection errors, HTTP 429/500/502/503/504, bodies cut short of their Content-Length and
    bodies that are not UTF-8 JSON are retried up to ``max_retries`` times with exponential backoff
    (``backoff_s · 2^k`` plus jitter, or the server's Retry-After when it is a valid delay; at most
    ``max_backoff_s``). A well-formed reply without text (``content: null``, e.g. a refusal, whose text the
    error quotes), other HTTP errors and oversized replies fail at once.
    """

    RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
    READ_CHUNK = 64 * 1024

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 60.0,
        deadline_s: float = 300.0,
        max_response_bytes: int = 4 * 1024 * 1024,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        temperature: float = 0.7,
        max_tokens: int = 1024,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"HTTPChatBackend.base_url must start with http:// or https://, got {base_url!r}")
        for option, value in (("timeout_s", timeout_s), ("deadline_s", deadline_s)):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"HTTPChatBackend.{option} must be a finite value > 0, got {value}")
        if max_response_bytes < 1024:
            raise ConfigError(f"HTTPChatBackend.max_response_bytes must be >= 1024, got {max_response_bytes}")
        if max_retries < 0:
            raise ConfigError(f"HTTPChatBackend.max_retries must be >= 0, got {max_retries}")
        if max_tokens < 1:
            raise ConfigError(f"HTTPChatBackend.max_tokens must be >= 1, got {max_tokens}")
        check_temperature("HTTPChatBackend.temperature", temperature)
        self.url = base_url.rstrip("/") + "/chat/completions"
        self._opener = urllib.request.build_opener(_RefuseRedirects)
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.max_response_bytes = max_response_bytes
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.temperature = temperature
        self.max_tokens = max_tokens

    def _request(self, messages: Messages, temperature: float | None, max_tokens: int | None) -> urllib.request.Request:
        body = {
            "model": self.model, "messages": messages,
            "temperature": self.temperature if temperature is None else temperature,
            "max_tokens": self.max_tokens if max_tokens is None else max_tokens,
        }
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        delay = self.backoff_s * 2**attempt * (1 + 0.1 * random.random()) if retry_after is None else retry_after
        return min(delay, self.max_backoff_s)

    def complete(self, messages: Messages, temperature: float | None = None, max_tokens: int | None = None) -> str:
        deadline = time.monotonic() + self.deadline_s
        request = self._request(messages, temperature, max_tokens)
        last_error = ""
        for attempt in range(self.max_retries + 1):
            try:
                return self._content(self._post(request, deadline))
            except _Retry as err:
                last_error = str(err)
                retry_after = err.retry_after
            if attempt == self.max_retries:
                break
            delay = self._delay(attempt, retry_after)
            if time.monotonic() + delay >= deadline:
                raise ChatBackendError(f"{self.url}: {last_error}; no time left for a retry within deadline_s = {self.deadline_s} s")
            log.info("%s: %s; retry %d/%d in %.2f s", self.url, last_error, attempt + 1, self.max_retries, delay)
            time.sleep(delay)
        raise ChatBackendError(f"{self.url}: {last_error} (gave up after {self.max_retries + 1} attempts)")

    def _remaining(self, deadline: float) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ChatBackendError(f"{self.url}: no complete reply within deadline_s = {self.deadline_s} s")
        return remaining

    def _timed_out(self, wait: float, what: str) -> Exception:
        """A wait that ran out: the call's deadline when it cut the wait short (not retried), else ``timeout_s``."""
        if wait < self.timeout_s:
            return ChatBackendError(f"{self.url}: no complete reply within deadline_s = {self.deadline_s} s ({what})")
        return _Retry(f"timed out after {self.timeout_s} s ({what})")

    def _post(self, request: urllib.request.Request, deadline: float) -> bytes:
        """One attempt: the raw body of a 2xx reply, or :class:`_Retry` / :class:`ChatBackendError`."""
        wait = min(self.timeout_s, self._remaining(deadline))
        try:
            response = self._opener.open(request, timeout=wait)
        except urllib.error.HTTPError as err:
            err.close()
            if 300 <= err.code < 400:
                raise ChatBackendError(
                    f"{self.url}: HTTP {err.code} redirect not followed (the API key is only sent to base_url); "
                    "set base_url to the final address"
                ) from None
            if err.code not in self.RETRY_STATUS:
                raise ChatBackendError(f"{self.url}: HTTP {err.code} {err.reason}") from None
            raise _Retry(f"HTTP {err.code} {err.reason}", retry_after_seconds(err.headers.get("Retry-After"))) from None
        except TimeoutError:
            raise self._timed_out(wait, "waiting for the reply") from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):
                raise self._timed_out(wait, "connect") from None
            raise _Retry(f"connection failed: {err.reason}") from None
        except (http.client.HTTPException, OSError) as err:  # e.g. the server closed without a status line
            raise _Retry(f"connection failed: {type(err).__name__}: {err}") from None
        with response:
            return self._read_body(response, deadline)

    def _read_body(self, response, deadline: float) -> bytes:
        """The whole body, read in chunks so the size cap and the deadline hold while it arrives."""
        declared = response.headers.get("Content-Length")
        declared = int(declared) if declared is not None and declared.strip().isdigit() else None
        if declared is not None and declared > self.max_response_bytes:
            raise ChatBackendError(f"{self.url}: reply of {declared} bytes is over max_response_bytes = {self.max_response_bytes}")
        sock = _socket_of(response)
        chunks, size = [], 0
        while True:
            wait = min(self.timeout_s, self._remaining(deadline))
            if sock is not None:
                sock.settimeout(wait)
            try:
                chunk = response.read1(self.READ_CHUNK)
            except TimeoutError:
                raise self._timed_out(wait, "reading the reply") from None
            except (http.client.HTTPException, OSError) as err:  # IncompleteRead of a chunked body, resets
                raise _Retry(f"reply cut short: {type(err).__name__}") from None
            if not chunk:
                break
            size += len(chunk)
            if size > self.max_response_bytes:
                raise ChatBackendError(f"{self.url}: reply is over max_response_bytes = {self.max_response_bytes}")
            chunks.append(chunk)
        if declared is not None and size < declared:
            raise _Retry(f"reply cut short: {size} of {declared} bytes")
        return b"".join(chunks)

    def _content(self, body: bytes) -> str:
        """``choices[0].message.content`` of a reply body; :class:`_Retry` for a garbled body, a
        :class:`ChatBackendError` for a well-formed reply without text."""
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as err:
            raise _Retry(f"reply is not UTF-8 ({err.reason} at byte {err.start})") from None
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as err:
            raise _Retry(f"reply is not JSON ({err.msg} at line {err.lineno} column {err.colno}): {text[:60]!r}") from None
        except RecursionError:
            raise _Retry("reply is JSON nested too deeply to read") from None
        try:
            message = payload["choices"][0]["message"]
            content = message.get("content")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise ChatBackendError(f"{self.url}: response has no choices[0].message.content") from None
        if content is None:
            refusal = message.get("refusal")
            detail = f" (refusal: {str(refusal)[:200]!r})" if refusal else ""
            raise ChatBackendError(f"{self.url}: the reply has no text (content: null){detail}")
        if not isinstance(content, str):
            raise ChatBackendError(f"{self.url}: choices[0].message.content is a {type(content).__name__}, not text")
        return content


@lru_cache(maxsize=4)
def _load_hf_chat_model(model: str, device: str):
    """One copy of a local chat model per (model, device): a rule source and a judge configured with the
    same model share its weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model).to(device).eval()


class HFChatBackend(ChatBackend):
    """A local Hugging Face causal LM (hub id or saved directory), prompted with its chat template when
    it has one, else with the messages joined as plain text. Backends naming the same ``model`` and
    ``device`` share one loaded copy."""

    def __init__(self, model: str, max_new_tokens: int = 512, temperature: float = 0.7, device: str = "cpu"):
        check_temperature("HFChatBackend.temperature", temperature)
        if max_new_tokens < 1:
            raise ConfigError(f"HFChatBackend.max_new_tokens must be >= 1, got {max_new_tokens}")
        self.tokenizer, self.model = _load_hf_chat_model(model, device)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.device = device

    def _prompt_ids(self, messages: Messages):
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
        text = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n\nassistant: "
        return self.tokenizer(text, return_tensors="pt")["input_ids"]

    def complete(self, messages: Messages, temperature: float | None = None, max_tokens: int | None = None) -> str:
        import torch

        temperature = self.temperature if temperature is None else temperature
        ids = self._prompt_ids(messages).to(self.device)
        with torch.no_grad():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens or self.max_new_tokens,
                do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
