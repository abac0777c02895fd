"""Rollouts from a ``flowkit rollout-server`` process (the ``server`` engine): generation on its own devices.

The trainer reaches the server over HTTP at ``rollout.server_url`` (JSON: ``GET /info``, ``POST /generate``,
``POST /weights``) and pushes its weights over torch.distributed after each optimizer step (or every
``rollout.server_sync_every`` steps): a two-member group of its own — the trainer's rank 0 and the server —
met at a ``TCPStore`` the trainer hosts, built directly as a gloo (CPU) or NCCL (GPU) process group, so neither
side's default group is touched and the server may serve trainer jobs one after another. Weights go in buckets of
``rollout.server_bucket_mb`` (whole tensors, LoRA merged, ZeRO-3 shards gathered one weight at a time by
:func:`flowkit.llm.vllm_engine.policy_weights`), so the push holds at most a bucket plus one weight.

With ``rollout.server_lora_push: adapter`` a LoRA policy's adapters travel alone: the first push over a channel
carries the base weights (the trainer's, unmerged: they may differ from the server's checkpoint) and the LoRA layout
(:func:`~flowkit.llm.vllm_engine.lora_layout`: per layer its adapters' rank and scaling), every later one only the
adapters' A and B and the weights that train outside them (:func:`~flowkit.llm.vllm_engine.adapter_weights`); the
server merges them into its copy of the base (:class:`flowkit.llm.server_backends.ServedAdapter`). A new channel
(after a failed push) starts over with the base.

Every wait has a bound (``rollout.server_timeout``): a server that is down, does not answer, restarted (its
instance id changed, so its weights are no longer the trainer's) or serves another model (compared at connect:
architecture, hidden size, layers, vocabulary) is one line naming the address, a :class:`ConfigError` at build
time and a :class:`RuntimeError` later.

With ``rollout.max_staleness`` k ≥ 1 the module keeps the next k batches' prompts prefetched
(:meth:`ServerRolloutEngine.prefetch`, :func:`flowkit.llm.engines.prefetch_ahead`) before the current step trains, and
the server generates them meanwhile, in order, from the weights it holds (up to k versions behind);
:meth:`ServerRolloutEngine.generate` takes those rollouts when asked for the same prompts, and regenerates a batch
more than k versions old (counted in :attr:`ServerRolloutEngine.regenerated_rows`).
"""

from __future__ import annotations

import json
import socket
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
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from flowkit.batch import RolloutBatch
from flowkit.distributed import all_reduce_int, zero3_sharded
from flowkit.errors import ConfigError
from flowkit.llm.packing import pack_response_rows
from flowkit.llm.vllm_engine import adapter_weights, lora_layout, policy_weights

if TYPE_CHECKING:
    from flowkit.llm.engines import EngineSetup

IDENTITY_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
"""The config fields that must agree between the trainer's policy and the server's model."""

_ALIGN = 64  # byte offset of every tensor in a bucket, so each is viewed in place as its own dtype
_CANCEL_POLL_S = 0.005  # how often a cancellable channel's wait looks for a cancellation

LoraPush = Literal["merged", "adapter"]
"""How a LoRA policy's weights reach the server (``rollout.server_lora_push``)."""


class PushReceipt(NamedTuple):
    """One push as the trainer sent it: tensors sent, tensors the server loaded, payload bytes (the buckets', each
    tensor's start aligned to 64 bytes; their small JSON headers not counted)."""

    sent: int
    loaded: int
    payload_bytes: int


def model_identity(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What identifies a model for the weight push: its config's :data:`IDENTITY_FIELDS` and the tokenizer's size."""
    return {**{field: getattr(config, field, None) for field in IDENTITY_FIELDS}, "tokenizer_size": len(tokenizer)}


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
        """The trainer's store, on a port the OS picks (``store.port``); the server joins it."""
        return torch.distributed.TCPStore(host, 0, world_size=2, is_master=True, timeout=timedelta(seconds=timeout_s),
                                          wait_for_workers=False)

    @staticmethod
    def join_store(host: str, port: int, timeout_s: float) -> torch.distributed.TCPStore:
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

    def _send_json(self, value: dict) -> None:
        data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(self.device)
        self._broadcast(torch.tensor([len(data)], device=self.device), 0)
        self._broadcast(data, 0)

    def _receive_json(self) -> dict:
        length = torch.zeros(1, dtype=torch.long, device=self.device)
        self._broadcast(length, 0)
        data = torch.empty(int(length), dtype=torch.uint8, device=self.device)
        self._broadcast(data, 0)
        return json.loads(data.cpu().numpy().tobytes().decode())

    def send(self, weights: Iterable[tuple[str, Tensor]], version: int, bucket_bytes: int) -> PushReceipt:
        """Push ``weights`` (member 0) in buckets of about ``bucket_bytes``; returns what was sent and how many
        tensors the server loaded, after its acknowledgement."""
        bucket: list[tuple[str, Tensor]] = []
        size = sent = payload_bytes = 0
        for name, tensor in weights:
            bucket.append((name, tensor))
            sent += 1
            size += _padded(tensor.numel() * tensor.element_size())
            if size >= bucket_bytes:
                payload_bytes += self._send_bucket(bucket, version, last=False)
                bucket, size = [], 0
        payload_bytes += self._send_bucket(bucket, version, last=True)
        ack = torch.zeros(2, dtype=torch.long, device=self.device)
        self._broadcast(ack, 1)
        if int(ack[0]) != version:
            raise RuntimeError(f"the server acknowledged version {int(ack[0])}, not {version}")
        return PushReceipt(sent, int(ack[1]), payload_bytes)

    def _send_bucket(self, bucket: list[tuple[str, Tensor]], version: int, last: bool) -> int:
        """One bucket; returns its payload's bytes."""
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

    def receive(self, load: Callable[[Iterator[tuple[str, Tensor]]], int]) -> tuple[int, int]:
        """Receive one push (the server): ``load`` consumes its ``(name, tensor)`` stream as the buckets arrive and
        returns how many tensors it loaded; then the push is acknowledged. Returns (version, tensors loaded)."""
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
        self._broadcast(torch.tensor([header["version"], loaded], device=self.device), 1)
        return header["version"], loaded


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass
class _Pending:
    """Rollouts the server generates in the background (:meth:`ServerRolloutEngine.prefetch`) for these prompts."""

    key: tuple
    reply: Future


class ServerRolloutEngine:
    """Samples ``n`` responses per prompt on a rollout server (``flowkit rollout-server``), in the HF engine's layout.

    Prompts are tokenized by the trainer's tokenizer; the server checks that it tokenizes them alike and returns
    each row's response token ids, its sampler's log-probs (as the HF engine's: after temperature and top-p) and the
    policy version it sampled from. Sampled requests carry a seed drawn from the trainer's torch RNG, so a seeded
    run is reproducible.

    Args:
        model, tokenizer: the policy and its tokenizer; the server's model must match (checked at connect).
        url: the server's address, e.g. ``http://10.0.0.5:8000``.
        timeout_s: bound of every wait (a request, a weight push, rollouts generated in the background).
        max_new_tokens, temperature, top_p: sampling, as the HF engine's.
        sync_every: push the weights every this many policy versions (1: after each optimizer step).
        bucket_mb: size of a weight-push bucket.
        max_staleness: accept rollouts up to this many policy versions old (0: the weights last pushed).
        rollout_batch_size: sequences per decoding batch on the server (bounds its KV cache); None: all at once.
        lora_push: a LoRA (peft) policy's weights go ``merged`` (every weight, each push) or as the ``adapter``
            (the base weights once per channel, then A and B alone; the server merges).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, url: str, timeout_s: float = 300.0,
                 max_new_tokens: int = 1024, temperature: float = 1.0, top_p: float = 1.0, sync_every: int = 1,
                 bucket_mb: int = 256, max_staleness: int = 0, rollout_batch_size: int | None = None,
                 lora_push: LoraPush = "merged"):
        if lora_push == "adapter" and not hasattr(model, "peft_config"):
            raise ValueError("lora_push 'adapter' needs a LoRA (peft) model")
        self.model, self.tokenizer, self.lora_push = model, tokenizer, lora_push
        self.rollout_batch_size = rollout_batch_size
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.sync_every, self.bucket_bytes, self.max_staleness = sync_every, bucket_mb << 20, max_staleness
        self.saw_nonfinite_logits = False
        self.policy_version = 0
        self.regenerated_rows = 0  # prefetched rows dropped as more than max_staleness versions old, then regenerated
        self.pushed_version: int | None = None  # the version the server holds (None: the backbone's, never pushed)
        self.instance: str | None = None  # the server process's id, so that a restart is noticed
        self.served_layout: dict | None = None  # adapter pushes: the LoRA layout the server holds our base weights for
        self.last_push: PushReceipt | None = None  # rank 0's latest push, as sent
        self._channel: WeightChannel | None = None
        self._pending: list[_Pending] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-prefetch") if max_staleness else None
        try:
            info = self._request("GET", "/info")
        except RuntimeError as err:
            raise ConfigError(str(err)) from None
        self.instance = info["instance"]
        differing = [f"{key} {info['identity'].get(key)} (trainer: {value})"
                     for key, value in model_identity(model.config, tokenizer).items() if info["identity"].get(key) != value]
        if differing:
            raise ConfigError(f"rollout server at {self.url} serves another model ({info['model']}: "
                              f"{', '.join(differing)})")

    # ------------------------------------------------------------------------------------------ HTTP
    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        """One JSON request, each socket operation bounded by the timeout; any failure is one line naming the
        address."""
        where = f"rollout server at {self.url}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]
            except (ValueError, KeyError, TypeError):
                pass
            raise RuntimeError(f"{where}: {path} failed ({err.code}: {detail})") from None
        except (TimeoutError, socket.timeout):
            raise RuntimeError(f"{where}: no answer to {path} within {self.timeout_s:g} s") from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, (TimeoutError, socket.timeout)):
                raise RuntimeError(f"{where}: no answer to {path} within {self.timeout_s:g} s") from None
            raise RuntimeError(f"{where}: unreachable ({err.reason})") from None
        except (OSError, ValueError) as err:  # reset mid-answer, or an answer that is not JSON
            raise RuntimeError(f"{where}: {path} failed ({type(err).__name__}: {err})") from None
        if self.instance is not None and reply.get("instance") != self.instance:
            raise RuntimeError(f"{where} restarted (instance {reply.get('instance')}, was {self.instance}): it no "
                               "longer holds the trainer's weights; resume the run from its last checkpoint")
        return reply

    # ------------------------------------------------------------------------------------------ weights
    def sync_weights(self, model: torch.nn.Module, version: int) -> None:
        """Every ``sync_every`` versions, push ``model``'s weights (every rank calls it at the same point: under
        ZeRO-3 gathering a weight is a collective; rank 0 sends)."""
        self.model, self.policy_version = model, version
        if self.pushed_version is None or version - self.pushed_version >= self.sync_every:
            self._push_agreed()

    def _ensure_pushed(self) -> None:
        """Before the first generation: the trainer's weights (a resumed or SFT'd policy), not the backbone's."""
        if self.pushed_version is None:
            self._push_agreed()

    def _push_agreed(self) -> None:
        try:
            self._agreed(self._push, f"weight push of version {self.policy_version}")
        except RuntimeError:
            self.served_layout = None  # on every rank: the next push, on a new channel, starts over with the base
            raise

    def _agreed(self, work: Callable[[], Any], what: str) -> Any:
        """``work()``, its failure agreed over the trainer's ranks: a rank that raised alone would leave the others
        waiting in the step's next collective (until the process group's timeout), so every rank raises, with its
        own line or one saying another rank failed."""
        error, result = None, None
        try:
            result = work()
        except RuntimeError as err:
            error = err
        if all_reduce_int(int(error is not None), ReduceOp.MAX):
            raise error or RuntimeError(f"rollout server at {self.url}: {what} failed on another rank") from None
        return result

    def _push(self) -> None:
        """One push: rank 0 sends, every rank walks the same weights (ZeRO-3: the gathers are collectives). As an
        adapter, the base weights go with the first push and whenever the LoRA layout changed (decided alike on
        every rank, from module attributes)."""
        version = self.policy_version
        body: dict[str, Any] = {"version": version}
        if self.lora_push == "adapter":
            layout = lora_layout(self.model)
            with_base = layout != self.served_layout
            body["lora"] = {"layout": layout if with_base else None}
            weights = adapter_weights(self.model, layout, with_base)
        else:
            layout, weights = None, policy_weights(self.model)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed and torch.distributed.get_rank() != 0:
            if zero3_sharded(self.model.parameters()):
                for _ in weights:  # rank 0's gathers need every rank's shard
                    pass
            self.pushed_version, self.served_layout = version, layout
            return
        try:
            if self._channel is None:
                self._channel = self._connect_channel()
            self._request("POST", "/weights", body)
            self.last_push = self._channel.send(weights, version, self.bucket_bytes)
            sent, loaded = self.last_push.sent, self.last_push.loaded
        except RuntimeError as err:  # the HTTP side's one line, or gloo / NCCL: the peer gone or past the timeout
            if zero3_sharded(self.model.parameters()):
                for _ in weights:  # the other ranks' gathers of the weights not sent yet
                    pass
            self._channel = None
            message = _first_line(err)
            if not message.startswith("rollout server at"):
                message = f"rollout server at {self.url}: weight push of version {version} failed ({message})"
            raise RuntimeError(message) from None
        if loaded != sent:
            raise RuntimeError(f"rollout server at {self.url}: loaded {loaded} of the {sent} weights of version "
                               f"{version} (see its log for the names it does not have)")
        self.pushed_version, self.served_layout = version, layout

    def _connect_channel(self) -> WeightChannel:
        """The trainer hosts the store on the interface it reaches the server through; the server joins it and
        says which device the group moves tensors on."""
        host = _local_address_towards(self.url)
        store = WeightChannel.host_store(host, self.timeout_s)
        device = next(self.model.parameters()).device
        reply = self._request("POST", "/weights/connect", {"host": host, "port": store.port, "device": device.type})
        # NCCL when both sides hold the weights on GPUs, else gloo (a GPU side then copies each bucket through host)
        return WeightChannel(store, 0, self.timeout_s, torch.device(reply["device"]))

    # ------------------------------------------------------------------------------------------ generation
    def prefetch(self, prompts: list[str], n: int, temperature: float | None = None) -> None:
        """Have the server start generating these prompts' rollouts now, from the weights it holds; a later
        :meth:`generate` of the same prompts takes them. Prefetches run one at a time, in order."""
        self._ensure_pushed()
        temperature = self.temperature if temperature is None else temperature
        request = self._generation_request(prompts, n, temperature)
        self._pending.append(_Pending((tuple(prompts), n, temperature),
                                      self._pool.submit(self._request, "POST", "/generate", request)))

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
        reply = self._agreed(lambda: self._reply(prompts, n, temperature), "generation")
        return self._batch(reply, prompts, n, answers)

    def _reply(self, prompts: list[str], n: int, temperature: float) -> dict:
        """The server's answer for these prompts: the prefetched one if not too stale, else a new request."""
        key = (tuple(prompts), n, temperature)
        pending = next((p for p in self._pending if p.key == key), None)
        reply = None
        if pending is not None:
            self._pending.remove(pending)
            try:
                reply = pending.reply.result(timeout=self.timeout_s)
            except FutureTimeout:
                raise RuntimeError(f"rollout server at {self.url}: prefetched rollouts not back within "
                                   f"{self.timeout_s:g} s") from None
            if self.policy_version - reply["version"] > self.max_staleness:
                self.regenerated_rows += len(prompts) * n
                reply = None
        if reply is None:
            reply = self._request("POST", "/generate", self._generation_request(prompts, n, temperature))
        return reply

    def _generation_request(self, prompts: list[str], n: int, temperature: float) -> dict:
        """The request; the server waits (bounded) until it holds at least the weights last pushed (``min_version``:
        on a rank other than 0 the push may still be on its way)."""
        seed = int(torch.randint(0, 2**32, ())) if temperature > 0 else 0  # NumPy's seed range (vLLM draws from it)
        return {"prompts": prompts, "n": n, "temperature": temperature, "top_p": self.top_p,
                "max_new_tokens": self.max_new_tokens, "rollout_batch_size": self.rollout_batch_size, "seed": seed,
                "min_version": self.pushed_version or 0, "wait_s": self.timeout_s / 2}  # the server's error first

    def _batch(self, reply: dict, prompts: list[str], n: int, answers: list[str] | None) -> RolloutBatch:
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
        ours = [row[mask.bool()].tolist() for row, mask in zip(encoded["input_ids"], encoded["attention_mask"])]
        if ours != reply["prompt_ids"]:
            raise RuntimeError(f"rollout server at {self.url} tokenizes the prompts differently from the trainer")
        batch = pack_response_rows(self.tokenizer, encoded, zip(reply["tokens"], reply["logprobs"]), prompts, n,
                                   answers)
        self.saw_nonfinite_logits = bool(reply["nonfinite"])
        batch.policy_versions = torch.full((batch.batch_size,), reply["version"])
        return batch.to(next(self.model.parameters()).device)

    def close(self) -> None:
        """Drop the prefetched rollouts and the weight channel (the server keeps running)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()
        self._channel, self.served_layout = None, None


def build_server_engine(setup: EngineSetup) -> ServerRolloutEngine:
    """The ``server`` engine from the rollout options' ``server_*`` and ``max_staleness``."""
    options = setup.options
    url = options.server_url
    parsed = urllib.parse.urlsplit(url or "")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"PolicyModule.rollout.engine 'server' needs rollout.server_url, the address `flowkit "
                          f"rollout-server` listens on (e.g. http://127.0.0.1:8000); got {url!r}")
    return ServerRolloutEngine(setup.policy, setup.tokenizer, url, options.server_timeout,
                               setup.max_new_tokens, setup.temperature, setup.top_p,
                               options.server_sync_every, options.server_bucket_mb,
                               options.max_staleness, options.batch_size, options.server_lora_push)


def _local_address_towards(url: str) -> str:
    """This host's address on the route to the server (a UDP socket picks the route; no packet is sent)."""
    parsed = urllib.parse.urlsplit(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((parsed.hostname, parsed.port or 80))
        return probe.getsockname()[0]


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
