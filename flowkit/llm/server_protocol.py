"""The rollout server's wire protocol, as both sides speak it (``flowkit rollout-server`` and
:mod:`flowkit.llm.server_engine`): the shared secret, the trainer run's header, and the checks of each request body.

Every request carries ``Authorization: Bearer <token>`` (the secret the server was started with: ``--token-file``
or :data:`TOKEN_ENV`) and, once the trainer has pushed, ``Flowkit-Run: <run id>`` (:data:`RUN_HEADER`); every reply
carries the server's ``instance`` and the ``run`` that holds its weight channel (``null``: none). A body that is not
what its route takes is :class:`RequestError` 400, one line naming the field.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from flowkit.errors import ConfigError

TOKEN_ENV = "FLOWKIT_SERVER_TOKEN"
RUN_HEADER = "Flowkit-Run"
SEED_RANGE = 2**32  # NumPy's (vLLM draws from it)


class RequestError(Exception):
    """A request the server answers with ``status`` and this one line (400: a malformed body)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def read_token(path: str | None, owner: str) -> str | None:
    """The shared secret: the file ``path`` (stripped), else :data:`TOKEN_ENV`, else None (no secret: a server
    started with ``--insecure-no-auth``). An unreadable or empty file is one :class:`ConfigError` naming ``owner``."""
    if path is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        token = Path(path).expanduser().read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{owner} {path}: cannot read the token file ({err.strerror or err})") from None
    if not token or any(ord(c) < 0x21 or ord(c) > 0x7E for c in token):
        raise ConfigError(f"{owner} {path}: the token file must hold one line of printable ASCII, no spaces")
    return token


def authorization(token: str) -> str:
    return f"Bearer {token}"


def _field(body: dict, name: str, kinds: tuple[type, ...], what: str, optional: bool = False) -> Any:
    if name not in body:
        if optional:
            return None
        raise RequestError(f"missing field {name!r} ({what})")
    value = body[name]
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise RequestError(f"field {name!r} must be {what}, got {json_type(value)}")
    return value


def json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def integer(body: dict, name: str, low: int, high: int | None = None, optional: bool = False) -> int | None:
    within = f">= {low}" if high is None else f"in [{low}, {high}]"
    value = _field(body, name, (int,), f"an integer {within}", optional)
    if value is not None and (value < low or (high is not None and value > high)):
        raise RequestError(f"field {name!r} must be an integer {within}, got {value}")
    return value


def number(body: dict, name: str, low: float, high: float | None = None, open_low: bool = False) -> float:
    within = f"{'>' if open_low else '>='} {low:g}" + ("" if high is None else f" and <= {high:g}")
    value = float(_field(body, name, (int, float), f"a finite number {within}"))
    if not math.isfinite(value) or value < low or (open_low and value == low) or (high is not None and value > high):
        raise RequestError(f"field {name!r} must be a finite number {within}, got {value!r}")
    return value


def json_object(body: Any, what: str = "the body") -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"{what} must be a JSON object, got {json_type(body)}")
    return body


def generation_request(body: Any, max_tokens: int, vocab_size: int, max_model_len: int | None = None) -> dict:
    """``POST /generate``'s body, checked: the prompts, ``n``, ``temperature``, ``top_p``, ``max_new_tokens``,
    ``rollout_batch_size`` (optional), ``seed``, ``min_version``, ``wait_s``, ``partial`` (optional, false: a push
    waits for the generation; true: it lands between two tokens). The prompts are ``prompts`` (a non-empty list of
    strings, which the server tokenizes) or, token-in, ``prompt_ids`` (a non-empty list of non-empty lists of token
    ids in ``[0, vocab_size)``, generated from as they are; each prompt's ids plus ``max_new_tokens`` at most
    ``max_model_len``, the model's context, when known). The tokens a request may cost are at most ``max_tokens``
    (the server's ``--max-request-tokens``): ``n × prompts × max_new_tokens``, token-in
    ``n × (prompt ids + prompts × max_new_tokens)``."""
    body = json_object(body)
    request = {"n": integer(body, "n", 1), "temperature": number(body, "temperature", 0),
               "top_p": number(body, "top_p", 0, 1, open_low=True),
               "max_new_tokens": integer(body, "max_new_tokens", 1),
               "rollout_batch_size": integer(body, "rollout_batch_size", 1, optional=True),
               "seed": integer(body, "seed", 0, SEED_RANGE - 1), "min_version": integer(body, "min_version", 0),
               "wait_s": number(body, "wait_s", 0), "partial": body.get("partial", False)}
    if not isinstance(request["partial"], bool):
        raise RequestError(f"field 'partial' must be a boolean, got {json_type(request['partial'])}")
    if "prompt_ids" in body:
        if "prompts" in body:
            raise RequestError("the body carries both 'prompts' and 'prompt_ids': send one of them")
        request["prompt_ids"] = _token_prompts(body["prompt_ids"], request, max_tokens, vocab_size, max_model_len)
        return request
    prompts = _field(body, "prompts", (list,), "a non-empty list of strings")
    if not prompts or not all(isinstance(prompt, str) for prompt in prompts):
        raise RequestError("field 'prompts' must be a non-empty list of strings")
    request["prompts"] = prompts
    tokens = request["n"] * len(prompts) * request["max_new_tokens"]
    if tokens > max_tokens:
        raise RequestError(f"n × prompts × max_new_tokens = {request['n']} × {len(prompts)} × "
                           f"{request['max_new_tokens']} = {tokens} is over this server's --max-request-tokens "
                           f"{max_tokens}: send fewer rows per request (more servers, or a smaller batch)")
    return request


def _token_prompts(prompts: Any, request: dict, max_tokens: int, vocab_size: int,
                   max_model_len: int | None) -> list[list[int]]:
    """``prompt_ids`` checked in order of cost: its shape and lengths (counts only), then every id's value."""
    if not (isinstance(prompts, list) and prompts
            and all(isinstance(ids, list) and ids for ids in prompts)):
        raise RequestError("field 'prompt_ids' must be a non-empty list of non-empty lists of token ids")
    n, max_new_tokens = request["n"], request["max_new_tokens"]
    tokens = n * (sum(map(len, prompts)) + len(prompts) * max_new_tokens)
    if tokens > max_tokens:
        raise RequestError(f"n × (prompt ids + prompts × max_new_tokens) = {n} × ({sum(map(len, prompts))} + "
                           f"{len(prompts)} × {max_new_tokens}) = {tokens} is over this server's "
                           f"--max-request-tokens {max_tokens}: send fewer or shorter prompts per request")
    longest = max(range(len(prompts)), key=lambda index: len(prompts[index]))
    if max_model_len is not None and len(prompts[longest]) + max_new_tokens > max_model_len:
        raise RequestError(f"prompt_ids[{longest}] has {len(prompts[longest])} ids: with max_new_tokens "
                           f"{max_new_tokens}, over the model's context of {max_model_len} tokens")
    for index, ids in enumerate(prompts):
        for position, token in enumerate(ids):
            if type(token) is not int or not 0 <= token < vocab_size:
                got = f"{token!r:.40}" if type(token) is int else json_type(token)
                raise RequestError(f"prompt_ids[{index}][{position}] must be a token id in [0, {vocab_size}), got "
                                   f"{got}")
    return prompts


def connect_request(body: Any) -> dict:
    """``POST /weights/connect``'s body: the ``port`` of the trainer's store (on the host the request came from)
    and the ``device`` its weights are on."""
    body = json_object(body)
    device = _field(body, "device", (str,), "'cpu' or 'cuda'")
    if device not in ("cpu", "cuda"):
        raise RequestError(f"field 'device' must be 'cpu' or 'cuda', got {device!r}")
    return {"port": integer(body, "port", 1, 65535), "device": device}


def weights_request(body: Any) -> dict:
    """``POST /weights``'s body: the pushed ``version`` and, for an adapter push, ``lora``: ``{layout}``, the
    layout an object of layers (each ``fan_in_fan_out`` and its ``adapters``' ``r`` and ``scaling``) or null."""
    body = json_object(body)
    request = {"version": integer(body, "version", 0), "lora": None}
    if body.get("lora") is not None:
        lora = json_object(body["lora"], "field 'lora'")
        layout = lora.get("layout")
        if layout is not None:
            for layer, entry in json_object(layout, "field 'lora.layout'").items():
                entry = json_object(entry, f"lora.layout[{layer!r}]")
                if not isinstance(entry.get("fan_in_fan_out"), bool):
                    raise RequestError(f"lora.layout[{layer!r}].fan_in_fan_out must be a boolean")
                for adapter, spec in json_object(entry.get("adapters"), f"lora.layout[{layer!r}].adapters").items():
                    spec = json_object(spec, f"lora.layout[{layer!r}].adapters[{adapter!r}]")
                    integer(spec, "r", 1)
                    number(spec, "scaling", -math.inf)
        request["lora"] = {"layout": layout}
    return request
