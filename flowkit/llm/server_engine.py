"""Rollouts from ``flowkit rollout-server`` processes (the ``server`` engine): generation on their own devices.

The trainer reaches each server over HTTP at an address of ``rollout.server_url`` (one, or a list: JSON over
``GET /info``, ``POST /generate``, ``POST /weights``) and pushes its weights over torch.distributed after each
optimizer step (or every ``rollout.server_sync_every`` steps): per server a two-member group of its own — one trainer
rank and the server — met at a ``TCPStore`` that rank hosts, built directly as a gloo (CPU) or NCCL (GPU) process
group, so neither side's default group is touched and a server may serve trainer jobs one after another. Weights go
in buckets of ``rollout.server_bucket_mb`` (whole tensors, LoRA merged, ZeRO-3 shards gathered one weight at a time
by :func:`flowkit.llm.vllm_engine.policy_weights`), so the push holds at most a bucket plus one weight.

**Several servers: data parallel.** With W trainer ranks and S servers (indices into the list), rank r generates on
the servers s with s mod W = r when S > W — its prompt batch split into contiguous slices of whole prompts, one
request per server sent concurrently, the rows put back in prompt order — else on server r mod S
(:func:`generation_servers`). Every server gets every push, server s from rank s mod W (:func:`pushed_servers`), so
the pushes run in parallel over ranks; a rank that pushes several servers sends each bucket to each of them in one
pass over the weights, and under ZeRO-3 every rank makes that one pass per push, pushing a server or not (each
weight's gather is a collective). The servers must serve the trainer's model (each one's identity is checked at build).

Every request carries the servers' secret (``rollout.server_token_file``, else ``FLOWKIT_SERVER_TOKEN``) and, from
the run's first push, its run id (one for all ranks, :mod:`flowkit.llm.server_protocol`): a server leases its weight
channel to the run that connected, and a reply saying another run holds it is one line (docs/security.md).

Every request has a bound (``rollout.server_timeout``) on the whole of it, not on each read, and on its reply's
size; a server that is down, does not answer in time, restarted (its instance id changed, so its weights are no
longer the trainer's) or serves another model (compared at connect: every config field that may change the logits,
:func:`model_identity`) is one line naming its address, a :class:`ConfigError` at build time and a
:class:`ServerError` (a :class:`~flowkit.errors.RunError`, which the CLI prints as its one line) later — on every
rank, the others learning of it through the agreed failure. So is a reply the trainer cannot have asked for
(:class:`ReplyCheck`): a policy version it never pushed, rows longer than ``max_new_tokens``,
token ids outside the vocabulary.

With ``rollout.max_staleness`` k ≥ 1 the module keeps the next k batches' prompts prefetched
(:meth:`ServerRolloutEngine.prefetch`, :func:`flowkit.llm.rollout_engine.prefetch_ahead`, split over the rank's
servers as a generation is) before the current step trains, and each server generates them meanwhile, in order, from
the weights it holds (up to k versions behind); :meth:`ServerRolloutEngine.generate` takes those rollouts when asked for
the same prompts, each row carrying the version of the server that generated it, and regenerates a server's share
more than k versions old (counted in :attr:`ServerRolloutEngine.regenerated_rows`). Agent episodes run ahead one
level up (:class:`flowkit.step.episodes.EpisodeRollout`): a later step's episodes call
:meth:`ServerRolloutEngine.generate_from_ids` from a thread of their own while this step trains and pushes, and a push
keeps accepting the versions those requests may still come back with.

With ``rollout.partial_rollouts`` a push does not wait for the generation in flight: the server lands it between two
decoding steps, the rows in flight go on from the new weights (their KV cache recomputed), and every token carries the
version that sampled it (the batch's ``policy_versions`` are B×S; a row's staleness is that of its oldest token, which
``max_staleness`` bounds as above).

With ``rollout.server_lora_push: adapter`` a LoRA policy's adapters travel alone: the first push over a channel
carries the base weights (the trainer's, unmerged: they may differ from the server's checkpoint) and the LoRA layout
(:func:`~flowkit.llm.vllm_engine.lora_layout`: per layer its adapters' rank and scaling), every later one only the
adapters' A and B and the weights that train outside them (:func:`~flowkit.llm.vllm_engine.adapter_weights`); each
server merges them into its copy of the base (:class:`flowkit.llm.server_backends.ServedAdapter`). A new channel
(after a failed push) starts over with the base.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import secrets
import socket
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from torch.distributed import ReduceOp
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from flowkit.batch import RolloutBatch
from flowkit.distributed import all_reduce_int, zero3_sharded
from flowkit.errors import ConfigError, RunError
from flowkit.llm.bounded_http import ReplyTooLarge, open_before, read_at_most
from flowkit.llm.packing import pack_response_rows
from flowkit.llm.rollout_engine import EngineSetup, TokenRollouts
from flowkit.llm.server_protocol import RUN_HEADER, authorization, read_token
from flowkit.llm.vllm_engine import adapter_weights, lora_layout, policy_weights

NOT_IDENTITY = frozenset({
    "_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "use_cache",
    "_attn_implementation", "_attn_implementation_autoset", "output_attentions", "output_hidden_states",
    "return_dict", "torchscript", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
    "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id"})
"""The config fields that need not agree between the trainer's policy and the server's model: where it was loaded
from, in which dtype and library version, how it runs (cache, attention kernel, outputs), how it was initialised
and its special tokens' ids. Every other field (sizes, heads, layers, activation, norm eps, rope settings,
tie_word_embeddings, attention biases, sliding windows, ...) may change the logits, so it must agree."""

_ALIGN = 64  # byte offset of every tensor in a bucket, so each is viewed in place as its own dtype
_CANCEL_POLL_S = 0.005  # how often a cancellable channel's wait looks for a cancellation
# A joining TCPStore client's first messages (c10d's QueryType VALIDATE with its magic number, then PING with a
# nonce the store echoes): :meth:`WeightChannel.store_answers` sends them to learn whether a store listens.
_STORE_VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)
_STORE_PING = b"\x0d"
SMALL_REPLY_BYTES = 1 << 20
"""Bound of a reply other than rollouts (``/info``, ``/weights``, an error): a server's ``/info`` is a few KB."""
REPLY_BYTES_PER_TOKEN = 64
"""Bound of a ``/generate`` reply per token it may carry: a token id, its log-prob and version take under 40 bytes of
JSON."""
_DETAIL_CHARS = 200  # of a server's own words quoted in an error

LoraPush = Literal["merged", "adapter"]
"""How a LoRA policy's weights reach the servers (``rollout.server_lora_push``)."""


class PushReceipt(NamedTuple):
    """One push as the trainer sent it: tensors sent, tensors each server loaded, payload bytes per server (the
    buckets', each tensor's start aligned to 64 bytes; their small JSON headers not counted)."""

    sent: int
    loaded: int
    payload_bytes: int


def model_identity(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What identifies a model for the weight push: its config's fields but those of :data:`NOT_IDENTITY`, a
    sub-config's or a dict's under dotted names (``rope_parameters.rope_theta``), as JSON carries them; and the
    tokenizer's size."""
    identity: dict[str, Any] = {}

    def flatten(fields: dict, prefix: str) -> None:
        for key, value in fields.items():
            if key in NOT_IDENTITY:
                continue
            if isinstance(value, dict) and value:
                flatten(value, f"{prefix}{key}.")
            else:
                identity[f"{prefix}{key}"] = value

    flatten(config.to_dict(), "")
    return json.loads(json.dumps({**identity, "tokenizer_size": len(tokenizer)}))


def identity_differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """``key theirs (trainer: ours)`` for each field both identities have and disagree on; a field only one side
    has is left out (another ``transformers`` version may name a field differently, or add one with its default)."""
    return [f"{key} {theirs[key]} (trainer: {value})" for key, value in ours.items()
            if key in theirs and theirs[key] != value]


class WeightChannel:
    """A two-member torch.distributed group: the trainer (member 0, which hosts the ``TCPStore``) and the server.

    Built without ``init_process_group`` (a process has one default group, and a ``new_group`` cannot span two
    jobs): the store and a gloo (CPU) or NCCL (GPU) process group are constructed directly, every operation bounded
    by ``timeout_s``. A push is a sequence of buckets, each a JSON header (its length, then its bytes) and one uint8
    payload broadcast from member 0, then the server's acknowledgement (version, tensors loaded) broadcast back.
    """

    def __init__(self, store: torch.distributed.Store, member: int, timeout_s: float, device: torch.device,
                 cancellable: bool = False):
        self.member, self.device = member, device
        self.timeout = timedelta(seconds=timeout_s)
        self.cancelled = threading.Event() if cancellable else None
        self._in_flight: torch.distributed.Work | None = None
        store = torch.distributed.PrefixStore("flowkit/weights", store)
        if device.type == "cuda":
            options = torch.distributed.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.group = torch.distributed.ProcessGroupNCCL(store, member, 2, options)
        else:
            self.group = torch.distributed.ProcessGroupGloo(store, member, 2, self.timeout)

    @staticmethod
    def host_store(host: str, timeout_s: float) -> torch.distributed.TCPStore:
        """The trainer's store, listening on ``host`` alone (a TCPStore of its own binds every interface), on a port
        the OS picks (``store.port``); the server joins it."""
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        return torch.distributed.TCPStore(host, port, world_size=2, is_master=True,
                                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                                          master_listen_fd=listener.detach())  # the store owns the socket now

    @staticmethod
    def store_answers(host: str, port: int, timeout_s: float) -> bool:
        """Whether a TCPStore answers at ``host:port`` within ``timeout_s``: its ping, as a joining client sends it
        (TCPStore's own join waits for that answer without a bound, so another kind of listener would hold it)."""
        nonce = os.urandom(4)
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as probe:
                probe.sendall(_STORE_VALIDATE + _STORE_PING + nonce)
                answer = b""
                while len(answer) < len(nonce):
                    chunk = probe.recv(len(nonce) - len(answer))
                    if not chunk:
                        return False
                    answer += chunk
        except OSError:
            return False
        return answer == nonce

    @staticmethod
    def join_store(host: str, port: int, timeout_s: float) -> torch.distributed.TCPStore:
        """The trainer's store at ``host:port`` (the server's side), once it answered as a store within
        ``timeout_s``; else a one-line ConnectionError."""
        if not WeightChannel.store_answers(host, port, timeout_s):
            raise ConnectionError(f"no TCPStore answered at {host}:{port} within {timeout_s:g} s")
        return torch.distributed.TCPStore(host, port, world_size=2, is_master=False,
                                          timeout=timedelta(seconds=timeout_s))

    def _broadcast(self, tensor: Tensor, root: int) -> None:
        options = torch.distributed.BroadcastOptions()
        options.rootRank, options.timeout = root, self.timeout
        if self.cancelled is not None and self.cancelled.is_set():
            raise RuntimeError("the push was abandoned: another trainer connected")
        work = self.group.broadcast([tensor], options)
        if self.cancelled is not None:  # gloo's abort() does not interrupt a wait: poll, so that cancel() can
            self._in_flight = work
            deadline = time.monotonic() + self.timeout.total_seconds()
            while not work.is_completed() and time.monotonic() < deadline:
                if self.cancelled.wait(_CANCEL_POLL_S):
                    raise RuntimeError("the push was abandoned: another trainer connected")
        work.wait(self.timeout)
        self._in_flight = None

    def cancel(self) -> None:
        """End a receive in progress (a cancellable channel): its wait raises within a few milliseconds."""
        self.cancelled.set()

    def close(self) -> None:
        """Wait out (within the timeout) an operation a cancelled receive left in flight, in the receiving thread:
        the process group's destructor would wait for it wherever the last reference drops (an HTTP answer)."""
        work, self._in_flight = self._in_flight, None
        if work is not None:
            try:
                work.wait(self.timeout)
            except RuntimeError:  # its peer is gone or past the timeout: what a cancelled push expects
                pass

    def _send_json(self, value: dict, root: int = 0) -> None:
        data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(self.device)
        self._broadcast(torch.tensor([len(data)], device=self.device), root)
        self._broadcast(data, root)

    def _receive_json(self, root: int = 0, limit: int | None = None) -> dict:
        length = torch.zeros(1, dtype=torch.long, device=self.device)
        self._broadcast(length, root)
        if limit is not None and not 0 <= int(length) <= limit:
            raise RuntimeError(f"a message of {int(length)} bytes, over its bound of {limit}")
        data = torch.empty(int(length), dtype=torch.uint8, device=self.device)
        self._broadcast(data, root)
        return json.loads(data.cpu().numpy().tobytes().decode())

    def send_bucket(self, bucket: list[tuple[str, Tensor]], version: int, last: bool) -> int:
        """Send one bucket of a push (member 0): :func:`weight_buckets` cuts the weights into them; returns its
        payload's bytes."""
        entries, offset = [], 0
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            entries.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes])
            offset += _padded(nbytes)
        payload = torch.zeros(offset, dtype=torch.uint8, device=self.device)
        for (_, tensor), (_, _, _, start, nbytes) in zip(bucket, entries):
            payload[start:start + nbytes] = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(self.device)
        self._send_json({"version": version, "entries": entries, "bytes": offset, "last": last})
        self._broadcast(payload, 0)
        return offset

    def acknowledgement(self, version: int, sampled: dict[str, Tensor] | None = None) -> int:
        """After a push's last bucket (member 0): how many tensors the server loaded. It reports the
        :func:`weight_digest` of each ``sampled`` weight (a few of those pushed, host copies) as it now holds them,
        in the dtype it holds them in, and each must be that of the weight pushed: a server that does not hold what
        it acknowledged is refused (one that cannot read a weight back under its pushed name leaves it out)."""
        sampled = sampled or {}
        self._send_json({"digests": sorted(sampled)})
        try:
            ack = self._receive_json(1, SMALL_REPLY_BYTES)
            acknowledged, loaded, digests = ack["version"], ack["loaded"], ack["digests"]
            differing = [name for name, (dtype, digest) in digests.items()
                         if weight_digest(sampled[name].to(getattr(torch, dtype))) != digest]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise RuntimeError(f"the server's acknowledgement is malformed ({type(err).__name__}: {err})") from None
        if acknowledged != version:
            raise RuntimeError(f"the server acknowledged version {acknowledged!r:.40}, not {version}")
        if differing:
            raise RuntimeError(f"the server holds other values for {differing[0]} than version {version} pushed "
                               f"(weight digests differ after the push)")
        return loaded

    def receive(self, load: Callable[[Iterator[tuple[str, Tensor]]], int],
                held: Callable[[str], Tensor | None] = lambda name: None) -> tuple[int, int]:
        """Receive one push (the server): ``load`` consumes its ``(name, tensor)`` stream as the buckets arrive and
        returns how many tensors it loaded; then the push is acknowledged with the :func:`weight_digest` of the
        weights the trainer asks for as ``held(name)`` gives them (what the model now holds under that name; None:
        not readable so). Returns (version, tensors loaded)."""
        header: dict = {}

        def tensors() -> Iterator[tuple[str, Tensor]]:
            while not header.get("last"):
                header.update(self._receive_json())
                payload = torch.empty(header["bytes"], dtype=torch.uint8, device=self.device)
                self._broadcast(payload, 0)
                for name, dtype, shape, start, nbytes in header["entries"]:
                    yield name, payload[start:start + nbytes].view(getattr(torch, dtype)).view(shape)

        stream = tensors()
        loaded = load(stream)
        for _ in stream:  # a loader that stopped early: the rest of the push still comes off the channel
            pass
        digests = {}
        for name in self._receive_json()["digests"]:
            tensor = held(name)
            if tensor is not None:
                digests[name] = [str(tensor.dtype).removeprefix("torch."), weight_digest(tensor)]
        self._send_json({"version": header["version"], "loaded": loaded, "digests": digests}, 1)
        return header["version"], loaded


def weight_digest(tensor: Tensor) -> str:
    """SHA-256 of a tensor's bytes (on the host)."""
    return hashlib.sha256(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def digested(name: str, tensor: Tensor) -> bool:
    """Whether a pushed weight may be one whose digest the servers report: a norm's 1-D weight (``…norm.weight``),
    which both backends hold under its pushed name as pushed — vLLM fuses q/k/v and gate/up (their biases too) and
    shards projections over tensor-parallel workers, but keeps norms whole on every worker."""
    return tensor.dim() == 1 and name.endswith("norm.weight")


def sampled_on_the_way(weights: Iterable[tuple[str, Tensor]], sampled: dict[str, Tensor]
                       ) -> Iterator[tuple[str, Tensor]]:
    """``weights``, keeping in ``sampled`` host copies of the first and the last norm weight (:func:`digested`;
    small, copied as they go by, as a ZeRO-3 weight is gathered for its turn only), whose digests the servers report
    after the push (:meth:`WeightChannel.acknowledgement`)."""
    first: tuple[str, Tensor] | None = None
    for name, tensor in weights:
        if digested(name, tensor):
            latest = (name, tensor.detach().to("cpu", copy=True))
            first = first or latest
            sampled.clear()
            sampled.update([first, latest])
        yield name, tensor


def weight_buckets(weights: Iterable[tuple[str, Tensor]], bucket_bytes: int
                   ) -> Iterator[tuple[list[tuple[str, Tensor]], bool]]:
    """``weights`` in buckets of about ``bucket_bytes`` (whole tensors; a bucket ends past the size), each with
    whether it is the push's last (the last may be empty)."""
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in weights:
        bucket.append((name, tensor))
        size += _padded(tensor.numel() * tensor.element_size())
        if size >= bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
    yield bucket, True


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def generation_servers(rank: int, world: int, count: int) -> list[int]:
    """The servers (indices into ``rollout.server_url``'s ``count``) that rank ``rank`` of ``world`` generates on:
    those s with s mod ``world`` = ``rank`` when there are more servers than ranks, else server ``rank`` mod
    ``count``."""
    return list(range(rank, count, world)) if count > world else [rank % count]


def pushed_servers(rank: int, world: int, count: int) -> list[int]:
    """The servers that rank ``rank`` of ``world`` pushes the weights to: those s with s mod ``world`` = ``rank``
    (none for a rank ≥ ``count``)."""
    return list(range(rank, count, world))


def server_urls(value: Any, owner: str) -> list[str]:
    """``rollout.server_url`` (one address or a list of them) as the list of addresses, without a trailing slash; a
    one-line :class:`ConfigError` naming the option's entry that is missing, not an address or listed twice."""
    listen = "the address `flowkit rollout-server` listens on (e.g. http://127.0.0.1:8000)"
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"{owner}.server_url is an empty list: give {listen}, or a list of such addresses")
        entries = [(f"{owner}.server_url[{index}]", entry) for index, entry in enumerate(value)]
    elif value is None or not _is_address(value):
        raise ConfigError(f"{owner}.engine 'server' needs {owner}.server_url, {listen} or a list of such addresses; "
                          f"got {value!r}")
    else:
        entries = [(f"{owner}.server_url", value)]
    urls: list[str] = []
    for key, entry in entries:
        if not _is_address(entry):
            raise ConfigError(f"{key} must be {listen}, got {entry!r}")
        url = entry.rstrip("/")
        if url in urls:
            raise ConfigError(f"{key} {url} is listed twice in {owner}.server_url: list each server once")
        urls.append(url)
    return urls


def _is_address(entry: Any) -> bool:
    """``http(s)://host[:port]``: the server answers at its root, so no path, query or fragment."""
    if not isinstance(entry, str):
        return False
    parsed = urllib.parse.urlsplit(entry)
    try:
        parsed.port  # raises for a port that is not a number in range
    except ValueError:
        return False
    return (parsed.scheme in ("http", "https") and bool(parsed.hostname) and not parsed.path.strip("/")
            and not parsed.query and not parsed.fragment)


class ServerError(RunError):
    """A failure concerning one server (its message names the address), which the ``flowkit`` CLI prints as its one
    line; ``index`` into ``rollout.server_url``, so that the other ranks name it too."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


class ServerLink:
    """The engine's view of one server: its address, the secret its requests carry (None: a server started with
    ``--insecure-no-auth``), the id of the process it first answered from (a restart changes it), the trainer run
    whose requests these are (None until the first push), the weight channel this rank pushes it through (None: not
    formed yet, or pushed by another rank), and a worker that sends this rank's prefetch requests to it one at a
    time, in order."""

    def __init__(self, index: int, url: str, timeout_s: float, prefetching: bool, token: str | None = None):
        self.index, self.url, self.timeout_s, self.token = index, url, timeout_s, token
        self.instance: str | None = None
        self.run: str | None = None
        self.channel: WeightChannel | None = None
        self.prefetcher = ThreadPoolExecutor(1, thread_name_prefix="rollout-prefetch") if prefetching else None

    def error(self, message: str) -> ServerError:
        """One line naming the address: ``rollout server at URL`` and ``message`` (starting ``:`` or a space)."""
        return ServerError(f"rollout server at {self.url}{message}", self.index)

    @contextlib.contextmanager
    def concerned(self, what: str) -> Iterator[None]:
        """A RuntimeError inside (gloo / NCCL: the peer gone or past the timeout) or an OSError (the route to the
        server) as one line naming the address."""
        try:
            yield
        except ServerError:
            raise
        except (RuntimeError, OSError) as err:
            raise self.error(f": {what} failed ({_first_line(err)})") from None

    def request(self, method: str, path: str, body: dict | None = None, reply_bytes: int = SMALL_REPLY_BYTES) -> dict:
        """One JSON request, the whole of it bounded by the timeout (a reply dripped a byte at a time fails at the
        bound, not each byte) and its reply read up to ``reply_bytes``; any failure is one line naming the
        address."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token is not None:
            headers["Authorization"] = authorization(self.token)
        if self.run is not None:
            headers[RUN_HEADER] = self.run
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with open_before(request, time.monotonic() + self.timeout_s) as response:
                reply = json.loads(read_at_most(response, reply_bytes))
        except urllib.error.HTTPError as err:
            detail, refusal = _error_detail(err)
            if refusal is not None:
                self._check_instance(refusal)  # a refusal from another process than the one first reached
            raise self.error(f": {path} failed ({err.code}: {detail})") from None
        except (TimeoutError, socket.timeout):
            raise self.error(f": no answer to {path} within {self.timeout_s:g} s") from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, (TimeoutError, socket.timeout)):
                raise self.error(f": no answer to {path} within {self.timeout_s:g} s") from None
            raise self.error(f": unreachable ({err.reason})") from None
        except ReplyTooLarge as err:
            raise self.error(f": {path} sent {err}") from None
        except (OSError, ValueError, http.client.HTTPException) as err:  # reset mid-answer, or not JSON
            raise self.error(f": {path} failed ({type(err).__name__}: {_one_line(str(err))})") from None
        if not isinstance(reply, dict):
            raise self.error(f": {path} answered {type(reply).__name__}, not a JSON object")
        self._check_instance(reply)
        if self.run is not None and reply.get("run") != self.run:
            raise self.error(f"'s weight channel was taken by another trainer run ({_one_line(str(reply.get('run')))}; "
                             f"this one: {self.run}) after this one sent no request for its --lease: the weights it "
                             "holds are no longer this run's; resume the run from its last checkpoint")
        return reply

    def _check_instance(self, reply: dict) -> None:
        if self.instance is not None and reply.get("instance") != self.instance:
            raise self.error(f" restarted (instance {_one_line(repr(reply.get('instance')))}, was {self.instance}): "
                             "it no longer holds the trainer's weights; resume the run from its last checkpoint")

    def connect(self, device: torch.device) -> None:
        """Form the weight channel: this rank hosts the store on the interface it reaches the server through (and
        listens on no other); the server joins it, on the address this request comes from, and says which device the
        group moves tensors on (NCCL when both sides hold the weights on GPUs, else gloo: a GPU side then copies
        each bucket through host memory)."""
        store = WeightChannel.host_store(_local_address_towards(self.url), self.timeout_s)
        reply = self.request("POST", "/weights/connect", {"port": store.port, "device": device.type})
        self.channel = WeightChannel(store, 0, self.timeout_s, torch.device(reply["device"]))

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.shutdown(wait=False, cancel_futures=True)
        self.channel = None


@dataclass
class _Share:
    """One server's share of a batch, ``prompts[start:stop]``: the oldest version its request accepts, the rows asked
    for and its reply (to come)."""

    server: ServerLink
    start: int
    stop: int
    min_version: int
    rows: int
    reply: Future


@dataclass
class _Pending:
    """Rollouts the servers generate in the background (:meth:`ServerRolloutEngine.prefetch`) for these prompts."""

    key: tuple
    shares: list[_Share]


class ReplyCheck:
    """What a ``/generate`` reply may hold, checked before any of it is trained on: a policy version the trainer
    pushed, not older than its request accepted; the rows asked for, each at most ``max_new_tokens`` token ids in
    ``[0, vocab_size)`` with one log-prob and one policy version each (pushed versions, from the reply's on, never
    going back); at most :meth:`bytes_for` its request of JSON."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, vocab_size: int):
        self.tokenizer, self.max_new_tokens, self.vocab_size = tokenizer, max_new_tokens, vocab_size
        self.versions: set[int] = set()  # the pushed versions a reply still awaited may carry
        self.latest: int | None = None

    def pushed(self, version: int, awaited: list[int]) -> None:
        """``version`` was pushed; the requests still ``awaited`` accept their ``min_version`` or later."""
        oldest = min(awaited, default=version)
        self.versions = {pushed for pushed in self.versions if pushed >= oldest} | {version}
        self.latest = version

    def bytes_for(self, request: dict) -> int:
        """The bound of a reply to ``request``: every row the longest prompt and ``max_new_tokens`` long,
        :data:`REPLY_BYTES_PER_TOKEN` each (a reply padded past it is refused before it is read whole)."""
        prompt_ids = request.get("prompt_ids") or self.tokenizer(request["prompts"])["input_ids"]
        longest = max(len(ids) for ids in prompt_ids)
        rows = len(prompt_ids) * request["n"]
        return SMALL_REPLY_BYTES + rows * (longest + self.max_new_tokens) * REPLY_BYTES_PER_TOKEN

    def check(self, share: _Share, reply: dict) -> None:
        """Refuse (one line naming the server) a reply the trainer cannot have asked for."""
        server, version, rows, logprobs = share.server, reply.get("version"), reply.get("tokens"), reply.get("logprobs")
        if type(version) is not int or version not in self.versions or version < share.min_version:
            raise server.error(f": /generate answered policy version {_one_line(repr(version))}, not one the trainer "
                               f"pushed from version {share.min_version} (asked for) to {self.latest}")
        token_versions = reply.get("token_versions")
        if not (isinstance(rows, list) and isinstance(logprobs, list) and isinstance(token_versions, list)
                and len(rows) == len(logprobs) == len(token_versions) == share.rows
                and type(reply.get("nonfinite")) is bool):
            raise server.error(f": /generate answered no {share.rows} rows of tokens, log-probs and versions with a "
                               "nonfinite flag")
        for row, (tokens, numbers, versions) in enumerate(zip(rows, logprobs, token_versions)):
            if not (isinstance(tokens, list) and isinstance(numbers, list) and len(tokens) == len(numbers)
                    and all(type(number) in (float, int) for number in numbers)):
                raise server.error(f": /generate row {row} is not a list of token ids and one log-prob per token")
            if len(tokens) > self.max_new_tokens:
                raise server.error(f": /generate row {row} has {len(tokens)} response tokens, more than "
                                   f"max_new_tokens {self.max_new_tokens}")
            outside = [token for token in tokens if type(token) is not int or not 0 <= token < self.vocab_size]
            if outside:
                raise server.error(f": /generate row {row} has token id {_one_line(repr(outside[0]))}, outside the "
                                   f"vocabulary (0 … {self.vocab_size - 1})")
            if not (isinstance(versions, list) and len(versions) == len(tokens)
                    and all(type(v) is int and v in self.versions for v in versions)
                    and versions == sorted(versions) and all(v >= version for v in versions)):
                raise server.error(f": /generate row {row} has no policy version per token, each one the trainer "
                                   f"pushed, from the reply's {version} on and never going back")


class ServerRolloutEngine:
    """Samples ``n`` responses per prompt on rollout servers (``flowkit rollout-server``), in the HF engine's layout.

    Prompts are tokenized by the trainer's tokenizer; each server checks that it tokenizes them alike and returns
    each row's response token ids, its sampler's log-probs (as the HF engine's: after temperature and top-p) and the
    policy version it sampled from. Sampled requests carry a seed drawn from the trainer's torch RNG (one per
    server's share, in server order), so a seeded run is reproducible.

    Args:
        model, tokenizer: the policy and its tokenizer; every server's model must match (checked at connect).
        urls: the servers' addresses, e.g. ``http://10.0.0.5:8000`` (one, or a list: data parallel, the module's
            docstring gives the rule).
        timeout_s: bound of every wait (a request, a weight push, rollouts generated in the background).
        max_new_tokens, temperature, top_p: sampling, as the HF engine's.
        sync_every: push the weights every this many policy versions (1: after each optimizer step).
        bucket_mb: size of a weight-push bucket.
        max_staleness: accept rollouts up to this many policy versions old (0: the weights last pushed).
        rollout_batch_size: sequences per decoding batch on a server (bounds its KV cache); None: all at once.
        partial_rollouts: a push lands between two tokens of the generation in flight instead of waiting for it.
        lora_push: a LoRA (peft) policy's weights go ``merged`` (every weight, each push) or as the ``adapter``
            (the base weights once per channel, then A and B alone; the server merges).
        token_file: the file holding the servers' secret (None: ``FLOWKIT_SERVER_TOKEN``, else no secret).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, urls: str | list[str],
                 timeout_s: float = 300.0, max_new_tokens: int = 1024, temperature: float = 1.0, top_p: float = 1.0,
                 sync_every: int = 1, bucket_mb: int = 256, max_staleness: int = 0,
                 rollout_batch_size: int | None = None, lora_push: LoraPush = "merged", token_file: str | None = None,
                 partial_rollouts: bool = False):
        if lora_push == "adapter" and not hasattr(model, "peft_config"):
            raise ValueError("lora_push 'adapter' needs a LoRA (peft) model")
        self.model, self.tokenizer, self.lora_push = model, tokenizer, lora_push
        self.rollout_batch_size, self.timeout_s, self.partial_rollouts = rollout_batch_size, timeout_s, partial_rollouts
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.sync_every, self.bucket_bytes, self.max_staleness = sync_every, bucket_mb << 20, max_staleness
        self.saw_nonfinite_logits, self.lockstep = False, False  # lockstep: its generation is no collective of ranks
        self.policy_version = 0
        self.regenerated_rows = 0  # prefetched rows dropped as more than max_staleness versions old, then regenerated
        self.pushed_version: int | None = None  # the version the servers hold (None: the backbone's, never pushed)
        self.replies = ReplyCheck(tokenizer, max_new_tokens, model.get_input_embeddings().num_embeddings)
        self.served_layout: dict | None = None  # adapter pushes: the LoRA layout the servers hold our base weights for
        self.last_push: PushReceipt | None = None  # this rank's latest push, as sent (None: it pushes no server)
        token = read_token(token_file, "PolicyModule.rollout.server_token_file")
        self.run: str | None = None  # this trainer run's id on the servers (their weight channels' lease), at 1st push
        self.servers = [ServerLink(index, url.rstrip("/"), timeout_s, prefetching=max_staleness > 0, token=token)
                        for index, url in enumerate([urls] if isinstance(urls, str) else urls)]
        self._requests = ThreadPoolExecutor(len(self.servers), thread_name_prefix="rollout-generate")
        self._pending: list[_Pending] = []
        self._token_in_flight: list[_Share] = []  # token-in requests awaited (a later step's episodes, in a thread)
        self._asking = threading.Lock()  # a token-in request is sent and counted, or a push's versions pruned: apart
        identity = model_identity(model.config, tokenizer)
        first_at: dict[str, str] = {}  # instance → the address it first answered at
        for server in self.servers:
            try:
                info = server.request("GET", "/info")
            except RuntimeError as err:
                raise ConfigError(str(err)) from None
            server.instance, theirs = info.get("instance"), info.get("identity")
            differing = identity_differences(identity, theirs) if isinstance(theirs, dict) else ["no identity"]
            if differing:
                raise ConfigError(f"rollout server at {server.url} serves another model "
                                  f"({_one_line(str(info.get('model')))}: {_one_line(', '.join(differing))})")
            if server.instance in first_at:
                raise ConfigError(f"rollout server at {server.url} is the one at {first_at[server.instance]} (the "
                                  "same process): list each server once in rollout.server_url")
            first_at[server.instance] = server.url

    # ------------------------------------------------------------------------------------------ weights
    def sync_weights(self, model: torch.nn.Module, version: int) -> None:
        """Every ``sync_every`` versions, push ``model``'s weights (every rank calls it at the same point: under
        ZeRO-3 gathering a weight is a collective; each server is pushed by one rank, :func:`pushed_servers`)."""
        self.model, self.policy_version = model, version
        if self.pushed_version is None or version - self.pushed_version >= self.sync_every:
            self._push_agreed()

    def _ensure_pushed(self) -> None:
        """Before the first generation: the trainer's weights (a resumed or SFT'd policy), not the backbone's."""
        if self.pushed_version is None:
            self._push_agreed()

    def _push_agreed(self) -> None:
        if self.run is None:  # one id for all ranks: a server is leased to the run, whichever rank pushes it
            self.run = f"{all_reduce_int(secrets.randbits(62), ReduceOp.MAX):016x}"
            for server in self.servers:
                server.run = self.run
        try:
            self._agreed(self._push, f"weight push of version {self.policy_version}")
        except RuntimeError:
            self.served_layout = None  # on every rank: the next push, on new channels, starts over with the base
            raise

    def _agreed(self, work: Callable[[], Any], what: str) -> Any:
        """``work()``, its failure agreed over the trainer's ranks: a rank that raised alone would leave the others
        waiting in the step's next collective (until the process group's timeout), so every rank raises, with its
        own line or one naming the server another rank failed on."""
        error, result = None, None
        try:
            result = work()
        except RuntimeError as err:
            error = err
        concerned = 0 if error is None else getattr(error, "index", len(self.servers)) + 1  # past the list: none
        failed = all_reduce_int(concerned, ReduceOp.MAX)
        if error is not None:
            raise error from None
        if failed:
            urls = [server.url for server in self.servers]
            where = f"rollout server at {urls[failed - 1]}" if failed <= len(urls) else \
                f"rollout servers at {', '.join(urls)}"
            raise ServerError(f"{where}: {what} failed on another rank", failed - 1)
        return result

    def _push(self) -> None:
        """Push the weights to this rank's servers in one pass over them; a rank that pushes none still makes the
        pass under ZeRO-3, whose gathers need every rank's shard. As an adapter, the base weights go with the first
        push and whenever the LoRA layout changed (decided alike on every rank, from module attributes)."""
        version = self.policy_version
        rank, world = _rank_and_world()
        mine = [self.servers[index] for index in pushed_servers(rank, world, len(self.servers))]
        body: dict[str, Any] = {"version": version}
        if self.lora_push == "adapter":
            layout = lora_layout(self.model)
            with_base = layout != self.served_layout
            body["lora"] = {"layout": layout if with_base else None}
            weights = adapter_weights(self.model, layout, with_base)
        else:
            layout, weights = None, policy_weights(self.model)
        try:
            if mine:
                self.last_push = self._send(mine, weights, body)
        finally:
            if zero3_sharded(self.model.parameters()):
                for _ in weights:  # the gathers of the weights not sent (all of them on a rank that pushes none)
                    pass
        with self._asking:
            self.pushed_version, self.served_layout = version, layout
            awaited = [share for pending in self._pending for share in pending.shares] + self._token_in_flight
            self.replies.pushed(version, [share.min_version for share in awaited])

    def _send(self, servers: list[ServerLink], weights: Iterator[tuple[str, Tensor]], body: dict) -> PushReceipt:
        """Announce the push (``body``: its version, and the LoRA layout of an adapter push) to each of ``servers``,
        send each bucket to each of them in turn, then take their acknowledgements; a failure drops the channels (a
        push that broke off leaves them mid-stream)."""
        version = body["version"]
        what = f"weight push of version {version}"
        try:
            for server in servers:
                with server.concerned(what):
                    if server.channel is None:
                        server.connect(next(self.model.parameters()).device)
                    server.request("POST", "/weights", body)
            sent = payload_bytes = 0
            sampled: dict[str, Tensor] = {}
            for bucket, last in weight_buckets(sampled_on_the_way(weights, sampled), self.bucket_bytes):
                sent += len(bucket)
                for server in servers:
                    with server.concerned(what):
                        nbytes = server.channel.send_bucket(bucket, version, last)
                payload_bytes += nbytes
            for server in servers:
                with server.concerned(what):
                    loaded = server.channel.acknowledgement(version, sampled)
                if loaded != sent:
                    raise server.error(f": loaded {loaded} of the {sent} weights of version {version} (see its log "
                                       "for the names it does not have)")
        except ServerError:
            for server in servers:
                server.channel = None
            raise
        return PushReceipt(sent, loaded, payload_bytes)

    # ------------------------------------------------------------------------------------------ generation
    def prefetch(self, prompts: list[str], n: int, temperature: float | None = None) -> None:
        """Have this rank's servers start generating these prompts' rollouts now (each its share), from the weights
        they hold; a later :meth:`generate` of the same prompts takes them. A server runs prefetches in order."""
        self._ensure_pushed()
        temperature = self.temperature if temperature is None else temperature
        shares = self._ask(prompts, n, temperature, lambda server: server.prefetcher)
        self._pending.append(_Pending((tuple(prompts), n, temperature), shares))

    def prefetched(self, prompts: list[str], n: int, temperature: float | None = None) -> bool:
        """Whether these prompts' rollouts were prefetched (and not taken yet)."""
        key = (tuple(prompts), n, self.temperature if temperature is None else temperature)
        return any(pending.key == key for pending in self._pending)

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int = 1, answers: list[str] | None = None,
                 temperature: float | None = None) -> RolloutBatch:
        """``n`` samples per prompt (prompt i → rows i·n … i·n+n−1); temperature 0 is greedy. Rollouts prefetched
        for these prompts are used when at most ``max_staleness`` versions old, else regenerated."""
        self._ensure_pushed()
        temperature = self.temperature if temperature is None else temperature

        def batch() -> RolloutBatch:
            replies = self._replies(prompts, n, temperature)
            self.saw_nonfinite_logits = any(reply["nonfinite"] for _, reply in replies)
            return _served_batch(self.tokenizer, replies, prompts, n, answers).to(next(self.model.parameters()).device)

        return self._agreed(batch, "generation")

    @torch.no_grad()
    def generate_from_ids(self, prompts: list[list[int]], max_new_tokens: list[int],
                          temperature: float | None = None) -> TokenRollouts:
        """Token-in/token-out (:class:`~flowkit.llm.rollout_engine.TokenInEngine`): the ids go to this rank's servers
        (``prompt_ids``, split as :meth:`generate` splits prompts) and their sampled ids come back as they are, each
        row cut at its own ``max_new_tokens``, each token with the version its server sampled it from. No
        collective: ranks run different numbers of turns, so a failure raises on this rank; and a later step's
        episodes call it from a thread of their own while this step trains and pushes (a push meanwhile keeps
        accepting the versions the request may come back with)."""
        self._ensure_pushed()
        temperature = self.temperature if temperature is None else temperature
        limits = [min(limit, self.max_new_tokens) for limit in max_new_tokens]
        with self._asking:
            shares = self._ask(prompts, 1, temperature, lambda server: self._requests, limits=limits)
            self._token_in_flight += shares
        try:
            replies = self._collect(shares)
        finally:
            with self._asking:
                self._token_in_flight = [share for share in self._token_in_flight if share not in shares]
        self.saw_nonfinite_logits = any(reply["nonfinite"] for _, reply in replies)
        return _token_rollouts(replies, limits)

    def _ask(self, prompts: list[str] | list[list[int]], n: int, temperature: float,
             worker: Callable[[ServerLink], ThreadPoolExecutor],
             slices: list[tuple[ServerLink, int, int]] | None = None, limits: list[int] | None = None) -> list[_Share]:
        """Send each server its slice of the prompts (``slices``, by default :meth:`_split`'s) through
        ``worker(server)``; with ``limits`` (each prompt's ``max_new_tokens``) the prompts are token ids."""
        shares = []
        for server, start, stop in (self._split(len(prompts)) if slices is None else slices):
            request = self._generation_request(n, temperature)
            if limits is None:
                request["prompts"] = prompts[start:stop]
            else:
                request["prompt_ids"], request["max_new_tokens"] = prompts[start:stop], max(limits[start:stop])
            reply = worker(server).submit(server.request, "POST", "/generate", request, self.replies.bytes_for(request))
            shares.append(_Share(server, start, stop, request["min_version"], (stop - start) * n, reply))
        return shares

    def _split(self, count: int) -> list[tuple[ServerLink, int, int]]:
        """This rank's servers (:func:`generation_servers`), each with its contiguous slice of ``count`` prompts:
        sizes differing by at most one, the larger first, none for a server left without a prompt."""
        rank, world = _rank_and_world()
        servers = [self.servers[index] for index in generation_servers(rank, world, len(self.servers))]
        size, larger = divmod(count, len(servers))
        shares, start = [], 0
        for position, server in enumerate(servers):
            stop = start + size + (position < larger)
            if stop > start:
                shares.append((server, start, stop))
            start = stop
        return shares

    def _replies(self, prompts: list[str], n: int, temperature: float) -> list[tuple[_Share, dict]]:
        """Each share's answer: the prefetched one if not too stale, else a new request (all of them at once)."""
        key = (tuple(prompts), n, temperature)
        pending = next((p for p in self._pending if p.key == key), None)
        if pending is None:
            return self._collect(self._ask(prompts, n, temperature, lambda server: self._requests))
        self._pending.remove(pending)
        replies = self._collect(pending.shares, within=self.timeout_s)
        stale = [index for index, (_, reply) in enumerate(replies)
                 if self.policy_version - reply["version"] > self.max_staleness]
        again = self._ask(prompts, n, temperature, lambda server: self._requests,
                          [(replies[index][0].server, replies[index][0].start, replies[index][0].stop)
                           for index in stale])
        for index, replaced in zip(stale, self._collect(again)):
            replies[index] = replaced
        self.regenerated_rows += sum(share.stop - share.start for share in again) * n
        return replies

    def _collect(self, shares: list[_Share], within: float | None = None) -> list[tuple[_Share, dict]]:
        """The shares' replies; prefetched ones ``within`` seconds (a request sent now is bounded by its own
        timeout)."""
        deadline = None if within is None else time.monotonic() + within
        replies = []
        for share in shares:
            try:
                reply = share.reply.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise share.server.error(f": prefetched rollouts not back within {within:g} s") from None
            self.replies.check(share, reply)
            replies.append((share, reply))
        return replies

    def _generation_request(self, n: int, temperature: float) -> dict:
        """The request but its prompts; the server waits (bounded) until it holds at least the weights last pushed
        (``min_version``: a server pushed by another rank may still be receiving them)."""
        seed = int(torch.randint(0, 2**32, ())) if temperature > 0 else 0  # NumPy's seed range (vLLM draws from it)
        return {"n": n, "temperature": temperature, "top_p": self.top_p,
                "max_new_tokens": self.max_new_tokens, "rollout_batch_size": self.rollout_batch_size, "seed": seed,
                "min_version": self.pushed_version or 0, "wait_s": self.timeout_s / 2,  # the server's error first
                "partial": self.partial_rollouts}

    def close(self) -> None:
        """Drop the prefetched rollouts and the weight channels (the servers keep running)."""
        self._requests.shutdown(wait=False, cancel_futures=True)
        for server in self.servers:
            server.close()
        self._pending.clear()
        self.served_layout = None


def _served_batch(tokenizer: PreTrainedTokenizerBase, replies: list[tuple[_Share, dict]], prompts: list[str], n: int,
                  answers: list[str] | None) -> RolloutBatch:
    """The shares' rows in prompt order, each token with the policy version that sampled it (B×S; a row's prompt and
    padding columns hold the version its generation started from); a server that tokenized its prompts otherwise
    than ``tokenizer`` is refused in one line."""
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    ours = [row[mask.bool()].tolist() for row, mask in zip(encoded["input_ids"], encoded["attention_mask"])]
    rows, versions = [], []
    for share, reply in replies:
        if ours[share.start:share.stop] != reply["prompt_ids"]:
            raise share.server.error(" tokenizes the prompts differently from the trainer")
        rows += zip(reply["tokens"], reply["logprobs"])
        versions += [(reply["version"], token_versions) for token_versions in reply["token_versions"]]
    batch = pack_response_rows(tokenizer, encoded, rows, prompts, n, answers)
    prompt_width = encoded["input_ids"].shape[1]
    batch.policy_versions = torch.tensor([first for first, _ in versions]).repeat_interleave(
        batch.input_ids.shape[1]).view_as(batch.input_ids).clone()
    for row, (_, token_versions) in enumerate(versions):
        batch.policy_versions[row, prompt_width:prompt_width + len(token_versions)] = torch.tensor(
            token_versions, dtype=torch.long)
    return batch


def _token_rollouts(replies: list[tuple[_Share, dict]], limits: list[int]) -> TokenRollouts:
    """The shares' rows in prompt order, each cut at its prompt's limit, with the version of each token as its server
    reported it."""
    rollouts = TokenRollouts([], [], [])
    for share, reply in replies:
        rows = zip(reply["tokens"], reply["logprobs"], reply["token_versions"])
        for row, (ids, logprobs, versions) in enumerate(rows, share.start):
            rollouts.ids.append(ids[:limits[row]])
            rollouts.logprobs.append(logprobs[:limits[row]])
            rollouts.versions.append(versions[:limits[row]])
    return rollouts


def build_server_engine(setup: EngineSetup) -> ServerRolloutEngine:
    """The ``server`` engine from the rollout options' ``server_*`` and ``max_staleness``."""
    options = setup.options
    return ServerRolloutEngine(setup.policy, setup.tokenizer, server_urls(options.server_url, "PolicyModule.rollout"),
                               options.server_timeout, setup.max_new_tokens, setup.temperature, setup.top_p,
                               options.server_sync_every, options.server_bucket_mb, options.max_staleness,
                               options.batch_size, options.server_lora_push, options.server_token_file,
                               options.partial_rollouts)


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _local_address_towards(url: str) -> str:
    """This host's address on the route to the server (a UDP socket picks the route; no packet is sent)."""
    parsed = urllib.parse.urlsplit(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((parsed.hostname, parsed.port or 80))
        return probe.getsockname()[0]


def _error_detail(reply: urllib.error.HTTPError) -> tuple[str, dict | None]:
    """The ``error`` of a server's error reply (JSON), else its text, on one line and clipped; and the reply itself
    when it is a JSON object (its ``instance`` says which server process refused)."""
    try:
        text = read_at_most(reply, SMALL_REPLY_BYTES).decode(errors="replace")
    except (OSError, ValueError) as err:  # ReplyTooLarge is a ValueError
        return f"unreadable ({err})", None
    try:
        refusal = json.loads(text)
        return _one_line(str(refusal["error"])), refusal
    except (ValueError, KeyError, TypeError):
        return _one_line(text), None


def _one_line(text: str) -> str:
    """``text`` on one line, clipped: a server's words go into the trainer's one-line error."""
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_CHARS else text[:_DETAIL_CHARS] + "…"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
