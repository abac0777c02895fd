"""Chat LLM backends for rule generation, actions and judging: an OpenAI-compatible HTTP endpoint
(vLLM, llama.cpp server, ...) or a local Hugging Face chat model."""

from __future__ import annotations

import json
import logging
import os
import random
import time
import urllib.error
import urllib.request

from flowkit.errors import ConfigError

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]


class ChatBackendError(RuntimeError):
    """The backend gave no completion (after its retries)."""


class ChatBackend:
    """Base class: ``complete(messages) -> text``; subclasses are chosen in the config by ``class_path``."""

    def complete(self, messages: Messages) -> str:
        raise NotImplementedError


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: urllib would re-send every header, the Authorization bearer key
    included, to whatever host the Location names (and turn the POST into a body-less GET)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # the 30x then surfaces as an HTTPError


class HTTPChatBackend(ChatBackend):
    """POST ``{base_url}/chat/completions`` (OpenAI-compatible).

    The API key is read from the environment variable named ``api_key_env`` at each call (never from the
    config, never logged); when unset no Authorization header is sent, as local servers expect.
    The key goes to ``base_url`` only: a 3xx redirect is never followed (it fails at once, naming the
    status), so credentials cannot be forwarded to another host; point ``base_url`` at the final address.
    Timeouts, connection errors and HTTP 429/500/502/503/504 are retried up to ``max_retries`` times
    with exponential backoff (``backoff_s · 2^k`` plus jitter, or the server's Retry-After if it is
    shorter than ``max_backoff_s``); other HTTP errors fail at once.
    """

    RETRY_STATUS = frozenset({429, 500, 502, 503, 504})

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        temperature: float = 0.7,
        max_tokens: int = 1024,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"HTTPChatBackend.base_url must start with http:// or https://, got {base_url!r}")
        if not timeout_s > 0:
            raise ConfigError(f"HTTPChatBackend.timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0:
            raise ConfigError(f"HTTPChatBackend.max_retries must be >= 0, got {max_retries}")
        if max_tokens < 1:
            raise ConfigError(f"HTTPChatBackend.max_tokens must be >= 1, got {max_tokens}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self._opener = urllib.request.build_opener(_RefuseRedirects)
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.temperature = temperature
        self.max_tokens = max_tokens

    def _request(self, messages: Messages) -> urllib.request.Request:
        body = {"model": self.model, "messages": messages, "temperature": self.temperature, "max_tokens": self.max_tokens}
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        delay = self.backoff_s * 2**attempt * (1 + 0.1 * random.random())
        if retry_after is not None:
            try:
                delay = float(retry_after)
            except ValueError:
                pass
        return min(delay, self.max_backoff_s)

    def complete(self, messages: Messages) -> str:
        last_error = ""
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                with self._opener.open(self._request(messages), timeout=self.timeout_s) as response:
                    payload = json.loads(response.read().decode())
                try:
                    return payload["choices"][0]["message"]["content"]
                except (KeyError, IndexError, TypeError):
                    raise ChatBackendError(f"{self.url}: response has no choices[0].message.content") from None
            except urllib.error.HTTPError as err:
                if 300 <= err.code < 400:
                    raise ChatBackendError(
                        f"{self.url}: HTTP {err.code} redirect not followed (the API key is only sent to base_url); "
                        "set base_url to the final address"
                    ) from None
                if err.code not in self.RETRY_STATUS:
                    raise ChatBackendError(f"{self.url}: HTTP {err.code} {err.reason}") from None
                last_error = f"HTTP {err.code} {err.reason}"
                retry_after = err.headers.get("Retry-After")
            except TimeoutError as err:
                last_error = f"timed out after {self.timeout_s} s ({type(err).__name__})"
            except urllib.error.URLError as err:
                if isinstance(err.reason, TimeoutError):
                    last_error = f"timed out after {self.timeout_s} s (connect)"
                else:
                    last_error = f"connection failed: {err.reason}"
            if attempt < self.max_retries:
                delay = self._delay(attempt, retry_after)
                log.warning("%s: %s; retry %d/%d in %.2f s", self.url, last_error, attempt + 1, self.max_retries, delay)
                time.sleep(delay)
        raise ChatBackendError(f"{self.url}: {last_error} (gave up after {self.max_retries + 1} attempts)")


class HFChatBackend(ChatBackend):
    """A local Hugging Face causal LM (hub id or saved directory), prompted with its chat template when
    it has one, else with the messages joined as plain text."""

    def __init__(self, model: str, max_new_tokens: int = 512, temperature: float = 0.7, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model).to(device).eval()
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

    def complete(self, messages: Messages) -> str:
        import torch

        ids = self._prompt_ids(messages).to(self.device)
        with torch.no_grad():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                do_sample=self.temperature > 0, temperature=self.temperature if self.temperature > 0 else None,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
