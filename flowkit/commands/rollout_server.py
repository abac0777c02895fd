"""`flowkit rollout-server`: generation in its own process, on its own devices, for trainers with
``rollout.engine: server`` (:mod:`flowkit.llm.server_engine`).

It loads its own copy of the backbone and serves, over HTTP with JSON (stdlib only, :mod:`.rollout_http`)::

    GET  /info              model name, identity (architecture, hidden size, layers, vocabulary), policy version,
                            generations in flight
    POST /generate          {prompts, n, temperature, top_p, max_new_tokens, rollout_batch_size, seed, min_version,
                            wait_s, partial}, or token-in {prompt_ids, ...}: the prompts as token ids, generated
                            from as they are (ids in the vocabulary, each prompt within the model's context)
                            → per row: response token ids, sampler log-probs and each token's policy version; the
                            version the generation started from
    POST /weights/connect   {port, device}: join the weight channel (a TCPStore + gloo / NCCL group) of the trainer
                            run named by the request's ``Flowkit-Run`` header, its store on the host the request
                            came from; abandons a push still arriving on the earlier channel (a trainer killed or
                            hung mid-push). Refused (409) while another run holds the channel (its lease)
                            → the device it moves tensors on (cuda: NCCL, both sides on GPUs; cpu: gloo)
    POST /weights           {version, lora}: receive one push on that channel (buckets), then load it; only from
                            the run holding the channel. ``lora`` (``rollout.server_lora_push: adapter``):
                            ``{layout}`` with the base weights and the adapters, ``{layout: null}`` with the adapters
                            alone, merged into the base kept from the channel's first push
                            (:class:`~flowkit.llm.server_backends.ServedAdapter`)

Every request carries the server's secret (``Authorization: Bearer <token>``, compared in constant time;
:mod:`flowkit.llm.server_protocol`): ``--token-file``, else ``FLOWKIT_SERVER_TOKEN``, else one generated and written
to a file of mode 0600 whose path is printed with the address (the token itself too when stdout is a terminal, never
into a log file); ``--insecure-no-auth`` serves anyone, on a loopback ``--host`` only. Every reply carries the
server's ``instance`` id (a trainer notices a restart) and the ``run`` holding the weight channel. A run holds it
from its connect until its process ends (its store stops answering) or ``--lease`` seconds pass without a request
from it. Each request is bounded: its body (``--max-body-mb``, refused from its Content-Length), its rows × tokens
(``--max-request-tokens``), the time to send it (``--read-timeout``), the connections served at once
(``--max-connections``); a malformed body is a 400 naming the field.

Generation runs on the server's own copy of the model (``--backend``, :mod:`flowkit.llm.server_backends`):
flowkit's HF decoding loop (``hf``, the default) or vLLM's in-process engine (``vllm``, built as the colocated
engine builds it; the pushed weights go through vLLM's loader). One generation runs at a time. A push waits for the
generation in flight and generations wait for a push in progress (one lock), so every reply comes from one policy
version — unless the request asks for ``partial`` rollouts (``rollout.partial_rollouts``): the generation then hands
the model to a push due between two of its tokens (the push waits one decoding step at most), and its rows go on from
the new weights, each token carrying the version that sampled it. After a push that failed part way, whatever the
failure, none is served until the next whole one (a partial generation it interrupted fails). Every generation is a
line of the log (rows, policy version, seconds). Start it before the trainer::

    flowkit rollout-server --backbone Qwen/Qwen2.5-Math-7B --dtype bfloat16 --host 0.0.0.0 --port 8000 --backend vllm \\
        --token-file ~/.flowkit-token

Several servers (one per GPU, or per node) generate data parallel for one trainer, which lists their addresses in
``rollout.server_url``; each is a process of its own, started alike on its own device and port.
``--tensor-parallel-size N`` shards the vLLM backend's model over N GPUs (vLLM's tensor parallelism; its workers
then run in processes of their own, and pushes arrive over gloo, :class:`VllmServerBackend`). The threat model:
docs/security.md.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from flowkit.commands.rollout_http import Limits, Request, RolloutHTTPServer, Route
from flowkit.errors import ConfigError
from flowkit.llm.backbone import torch_dtype
from flowkit.llm.server_backends import HFServerBackend, ServedAdapter, VllmServerBackend
from flowkit.llm.server_engine import WeightChannel, model_identity
from flowkit.llm.server_protocol import (
    TOKEN_ENV, RequestError, connect_request, generation_request, read_token, weights_request,
)
from flowkit.llm.vllm_engine import seed_sampling
from flowkit.registry import standalone

log = logging.getLogger(__name__)

TORN = -1
"""The version after a push that failed part way (the model holds a mix of two versions): below every request's
``min_version``, so nothing is generated until the next whole push."""
LEASE_S = 600.0  # --lease: a trainer step (its generation, update, validation, checkpoint) takes less
MAX_REQUEST_TOKENS = 2**24  # --max-request-tokens: 512 prompts × 16 samples × 2048 tokens
PROBE_S = 2.0  # how long a holder's store has to answer before its run counts as gone (a stopped or vanished host)


@dataclass
class Lease:
    """The trainer run holding the weight channel: its id, its store's address, when it last sent a request."""

    run: str
    host: str
    port: int
    seen: float


class RolloutService:
    """The server's state: its backend (model and generator), the policy version it holds, the weight channel and
    the run holding it (:class:`Lease`), one lock for the model."""

    def __init__(self, backend: HFServerBackend | VllmServerBackend, backbone: str, timeout_s: float,
                 lease_s: float = LEASE_S, max_request_tokens: int = MAX_REQUEST_TOKENS):
        self.backend, self.backbone, self.timeout_s = backend, backbone, timeout_s
        self.lease_s, self.max_request_tokens = lease_s, max_request_tokens
        self.tokenizer = backend.tokenizer
        self.instance = uuid.uuid4().hex
        self.version = 0
        self.channel: WeightChannel | None = None
        self.adapter: ServedAdapter | None = None  # the base weights and adapters of a LoRA pushed as an adapter
        self.lease: Lease | None = None
        self.connecting = threading.Lock()  # one connect at a time: the lease is checked and taken in one piece
        self.joined = threading.Event()  # set once a trainer's channel is formed (or failed to form)
        self.ready = threading.Condition()  # guards the model and the version; notified when a push ends
        self.push_due = threading.Event()  # a push waits for the model: a partial generation hands it over
        self.turn = threading.Lock()  # one generation at a time (a paused one's requests stay in vLLM's engine)
        self.in_flight = 0  # generations running
        self.decoding_step = 0  # the step the running generation decodes (0 before its first): its progress

    def routes(self) -> dict[tuple[str, str], Route]:
        return {("GET", "/info"): self.info, ("POST", "/generate"): self.generate,
                ("POST", "/weights/connect"): self.connect, ("POST", "/weights"): self.receive_weights}

    def stamp(self) -> dict:
        """What every reply carries: this process's instance id and the run holding the weight channel."""
        lease = self.lease
        return {"instance": self.instance, "run": None if lease is None else lease.run}

    def _seen(self, run: str | None) -> None:
        lease = self.lease
        if lease is not None and run == lease.run:
            lease.seen = time.monotonic()

    def info(self, request: Request) -> dict:
        self._seen(request.run)
        return {"model": self.backbone, "identity": model_identity(self.backend.config, self.tokenizer),
                "version": self.version, "in_flight": self.in_flight, "decoding_step": self.decoding_step}

    def generate(self, request: Request) -> dict:
        asked = generation_request(request.body, self.max_request_tokens, self.backend.vocab_size,
                                   self.backend.max_model_len)
        self._seen(request.run)
        wait_s = min(asked["wait_s"], self.timeout_s)
        with self.turn, self.ready:
            if not self.ready.wait_for(lambda: self.version >= asked["min_version"], timeout=wait_s):
                raise TimeoutError(f"holds policy version {self.version}; version {asked['min_version']} was not "
                                   f"pushed within {wait_s:g} s")
            started, first = time.time(), self.version
            if asked["temperature"] > 0:
                seed_sampling(asked["seed"])
            token_in = "prompt_ids" in asked
            prompts = asked["prompt_ids"] if token_in else asked["prompts"]
            prompt_ids = prompts if token_in else self.tokenizer(prompts)["input_ids"]
            self.in_flight, self.decoding_step = self.in_flight + 1, 0
            try:
                rows, nonfinite = self.backend.generate(
                    prompt_ids, asked["n"], asked["temperature"], asked["top_p"], asked["max_new_tokens"],
                    asked["rollout_batch_size"], partial(self._between_tokens, asked["partial"]))
            finally:
                self.in_flight, self.decoding_step = self.in_flight - 1, 0
            log.info("generated %d rows (%d prompts × %d) from policy version %d to %d in %.2f s", len(rows),
                     len(prompts), asked["n"], first, self.version, time.time() - started)
            reply = {} if token_in else {"prompt_ids": prompt_ids}
            return {**reply, "tokens": [tokens for tokens, _, _ in rows],
                    "logprobs": [logprobs for _, logprobs, _ in rows], "nonfinite": nonfinite, "version": first,
                    "token_versions": [versions for _, _, versions in rows], "started": started,
                    "finished": time.time()}

    def _between_tokens(self, partial_rollouts: bool) -> int:
        """A generation between two decoding steps (its thread holds the model); for a partial one, a push waiting
        for the model lands now (bounded by the push's own timeout). Returns the version the next step samples from."""
        self.decoding_step += 1
        if partial_rollouts and self.push_due.is_set():
            self.ready.wait_for(lambda: not self.push_due.is_set(), timeout=self.timeout_s)
        if self.version == TORN:
            raise RuntimeError("a weight push failed part way through this generation (see the log)")
        return self.version

    def _holder_other_than(self, run: str) -> Lease | None:
        """The lease of another run that still holds the channel: a request from it within ``lease_s`` and its
        store answering (a run whose process ended, or that is stopped, holds nothing)."""
        lease = self.lease
        if lease is None or lease.run == run or time.monotonic() - lease.seen >= self.lease_s:
            return None
        return lease if WeightChannel.store_answers(lease.host, lease.port, min(PROBE_S, self.timeout_s)) else None

    def connect(self, request: Request) -> dict:
        """Join the store of the run named by the request, on the host the request came from, then its group in the
        background (the trainer forms its side after this answer). The run takes the channel unless another one
        holds it; a push still arriving on the earlier channel (a trainer killed or hung mid-push, now resumed) is
        abandoned at once instead of holding the model until its timeout."""
        asked = connect_request(request.body)
        run = request.run
        if not run:
            raise RequestError("POST /weights/connect needs the trainer run's id in its Flowkit-Run header")
        with self.connecting:
            holder = self._holder_other_than(run)
            if holder is not None:
                raise RequestError(f"the weight channel is held by trainer run {holder.run} (its last request "
                                   f"{time.monotonic() - holder.seen:.0f} s ago): it is released when that run's "
                                   f"process ends or after --lease {self.lease_s:g} s without a request from it", 409)
            try:
                store = WeightChannel.join_store(request.host, asked["port"], self.timeout_s)
            except (RuntimeError, OSError) as err:
                raise RequestError(f"no weight-channel store at {request.host}:{asked['port']} ({err})") from None
            device = self.backend.device if asked["device"] == "cuda" and self.backend.device.type == "cuda" \
                else torch.device("cpu")
            self._take(Lease(run, request.host, asked["port"], time.monotonic()), store, device)
        return {"device": device.type}

    def _take(self, lease: Lease, store: torch.distributed.Store, device: torch.device) -> None:
        """Give the channel to ``lease``'s run: the earlier channel's push abandoned, the new group formed."""
        if self.channel is not None:
            self.channel.cancel()
        self.channel, self.adapter, self.lease = None, None, lease
        self.joined = joined = threading.Event()

        def join() -> None:
            try:
                channel = WeightChannel(store, 1, self.timeout_s, device, cancellable=True)
                if self.joined is joined:  # not superseded by a later connect meanwhile
                    self.channel = channel
            except RuntimeError as err:
                log.error("weight channel to %s:%s not formed: %s", lease.host, lease.port, err)
            joined.set()

        threading.Thread(target=join, daemon=True).start()

    def receive_weights(self, request: Request) -> dict:
        """Receive a push in the background (the trainer sends after this answer), holding the model meanwhile; only
        from the run holding the channel, refused before the model is touched otherwise. A push that fails part
        way, whatever the failure, leaves the model part old, part new: no version is served until a whole push."""
        asked = weights_request(request.body)
        lease = self.lease
        if lease is None or request.run != lease.run:
            raise RequestError("POST /weights from a run that does not hold the weight channel: connect first "
                               "(POST /weights/connect)", 409)
        self._seen(request.run)
        version, lora = asked["version"], asked["lora"]

        def receive() -> None:
            if not self.joined.wait(self.timeout_s) or self.channel is None:
                log.error("push of version %d: no weight channel", version)
                return
            channel, failed = self.channel, False
            due = time.monotonic()
            self.push_due.set()
            with self.ready:
                waited = time.monotonic() - due
                try:
                    received, loaded = channel.receive(self._loader(channel, version, lora), self.backend.held)
                except Exception as err:  # the trainer gone or superseded, past the timeout, or a malformed push
                    log.error("push of version %d failed: %s: %s", version, type(err).__name__, err)
                    self.version, self.adapter, failed = TORN, None, True
                    if self.channel is channel:
                        self.channel = None
                else:
                    self.version = received
                finally:
                    self.push_due.clear()
                    self.ready.notify_all()
            if failed:
                channel.close()  # outside the lock: a cancelled push's operation ends within its timeout
                return
            log.info("policy version %d loaded (%d tensors; waited %.3f s for the model)", received, loaded, waited)

        threading.Thread(target=receive, daemon=True).start()
        return {}

    def _loader(self, channel: WeightChannel, version: int, lora: dict | None) -> Callable[[Iterable], int]:
        """What loads the push: the backend directly, or (an adapter push) the channel's :class:`ServedAdapter` — a
        new one with the base weights, the one of this channel's first push with adapters alone — then the
        backend from its merged weights. An adapter alone with no base of its channel loads nothing (the trainer,
        told 0 were loaded, stops with one line)."""
        if lora is None:
            self.adapter = None
            return self.backend.load
        if lora["layout"] is not None:
            self.adapter = ServedAdapter(lora["layout"], self.backend.shapes, channel, self.backbone)
        adapter = self.adapter

        def load(weights: Iterable) -> int:
            if adapter is None or adapter.channel is not channel:
                log.error("push of version %d: adapters without base weights on this channel", version)
                return 0
            received = adapter.receive(weights)
            missing = adapter.missing()
            if missing:
                log.error("push of version %d: no %s (nor %d more adapter tensors); nothing merged", version,
                          missing[0], len(missing) - 1)
                return 0
            self.backend.load(adapter.merged(self.backend.device))
            return received

        return load



def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="flowkit rollout-server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", required=True, help="hub id, local dir or bundled:tiny_adder (the trainer's)")
    parser.add_argument("--dtype", default="float32", help="parameter dtype (bfloat16 for real models)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=_bounded(int, 0, 65535), default=8000,
                        help="port to listen on (0: one the OS picks, printed)")
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf",
                        help="what generates: flowkit's HF decoding loop, or vLLM's engine (pip install flowkit[vllm])")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the hf backend's model runs (default: the GPU if there is one; vllm: vLLM's own)")
    parser.add_argument("--gpu-memory-utilization", type=_bounded(float, 0, 1, open_low=True), default=0.9,
                        help="vllm: share of the GPU's memory for weights and KV cache (CPU: VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--max-model-len", type=_bounded(int, 1), default=None,
                        help="vllm: longest prompt + response its KV cache is planned for (default: the model's)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="vllm: GPUs (on CPU: worker processes) the model is sharded over, vLLM's tensor "
                             "parallelism")
    parser.add_argument("--timeout", type=_bounded(float, 0, open_low=True), default=300.0,
                        help="seconds any wait on a trainer may take")
    parser.add_argument("--token-file", default=None,
                        help=f"file holding the secret every request must carry (default: ${TOKEN_ENV}, else one "
                             "generated into a file of mode 0600, its path printed, on a terminal the token too)")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="serve requests without the secret (only with a loopback --host)")
    parser.add_argument("--lease", type=_bounded(float, 0, open_low=True), default=LEASE_S,
                        help="seconds without a request after which a live trainer run's weight channel may be taken "
                             "by another run")
    parser.add_argument("--max-body-mb", type=_bounded(float, 0, open_low=True), default=16.0,
                        help="largest request body (refused from its Content-Length, unread)")
    parser.add_argument("--max-request-tokens", type=_bounded(int, 1), default=MAX_REQUEST_TOKENS,
                        help="largest n × prompts × max_new_tokens of one /generate request (token-in: "
                             "n × (prompt ids + prompts × max_new_tokens))")
    parser.add_argument("--max-connections", type=_bounded(int, 1), default=64,
                        help="connections served at once (more wait in the kernel's backlog)")
    parser.add_argument("--read-timeout", type=_bounded(float, 0, open_low=True), default=10.0,
                        help="seconds a request (headers and body) may take to arrive")
    return parser


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line (the CLI's), not the usage and exit code 2 of argparse
        raise ConfigError(f"flowkit rollout-server: {message}")


def _bounded(kind: type, low: float, high: float | None = None, open_low: bool = False) -> Callable[[str], float]:
    """An argparse type: ``kind`` within [low, high] (``open_low``: above low), finite."""
    within = f"{'>' if open_low else '>='} {low:g}" + ("" if high is None else f" and <= {high:g}")

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'} {within}, "
                                             f"got {text!r}") from None
        if not math.isfinite(value) or value < low or (open_low and value == low) or (
                high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a finite number'} "
                                             f"{within}, got {text!r}")
        return value

    return parse


def _check(options: argparse.Namespace) -> str | None:
    """The option combinations argparse cannot check, before any model loads; returns the secret (None: no auth)."""
    if options.tensor_parallel_size < 1:
        raise ConfigError(f"flowkit rollout-server --tensor-parallel-size must be >= 1, got "
                          f"{options.tensor_parallel_size}")
    if options.tensor_parallel_size > 1 and options.backend != "vllm":
        raise ConfigError("flowkit rollout-server --tensor-parallel-size > 1 needs --backend vllm (the hf backend "
                          "runs one model on one device)")
    try:
        torch_dtype(options.dtype)
    except ConfigError as err:
        raise ConfigError(f"flowkit rollout-server --{err}") from None
    try:
        torch.device(options.device)
    except RuntimeError:
        raise ConfigError(f"flowkit rollout-server --device must be a torch device (cpu, cuda, cuda:1), got "
                          f"{options.device!r}") from None
    if options.insecure_no_auth:
        if options.token_file is not None:
            raise ConfigError("flowkit rollout-server: --insecure-no-auth and --token-file contradict each other")
        if not _loopback(options.host):
            raise ConfigError(f"flowkit rollout-server --insecure-no-auth serves anyone who reaches --host "
                              f"{options.host}: allowed on a loopback address (127.0.0.1, ::1, localhost) only")
        return None
    return read_token(options.token_file, "flowkit rollout-server --token-file")


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _generated_token(port: int) -> tuple[str, Path]:
    """A new secret, written to a file only this user can read (in ``$XDG_RUNTIME_DIR``, else ``~/.cache``)."""
    directory = Path(os.environ.get("XDG_RUNTIME_DIR") or Path.home() / ".cache") / "flowkit"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"rollout-server-{port}.token"
    token = secrets.token_urlsafe(32)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as file:
        os.fchmod(descriptor, 0o600)  # a file that existed keeps its mode through O_CREAT
        file.write(token + "\n")
    return token, path


@standalone("rollout-server")
def rollout_server_command(argv: list[str]) -> None:
    """serve rollout generation over HTTP for `rollout.engine: server` trainers: flowkit rollout-server --backbone
    MODEL --port N"""
    options = _parser().parse_args(argv)
    token = _check(options)
    limits = Limits(int(options.max_body_mb * 2**20), options.max_connections, options.read_timeout, options.timeout)
    try:  # bound before the model loads: a taken port or an unknown host is one line at once
        server = RolloutHTTPServer((options.host, options.port), token, limits)
    except (OSError, OverflowError) as err:
        raise ConfigError(f"flowkit rollout-server cannot listen on {options.host}:{options.port} "
                          f"({getattr(err, 'strerror', None) or err})") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        if options.backend == "vllm":
            backend = VllmServerBackend(options.backbone, options.dtype, options.gpu_memory_utilization,
                                        options.max_model_len, options.tensor_parallel_size)
        else:
            backend = HFServerBackend(options.backbone, options.dtype, options.device)
        service = RolloutService(backend, options.backbone, options.timeout, options.lease,
                                 options.max_request_tokens)
        server.routes, server.stamp = service.routes(), service.stamp
        port = server.server_address[1]
        announced = ""
        if token is None and not options.insecure_no_auth:
            token, path = _generated_token(port)
            server.token = token
            if sys.stdout.isatty():  # shown once to whoever started it; a log file may be readable by others
                announced = (f"token {token} (also in {path}, mode 0600): give trainers this token in "
                             f"{TOKEN_ENV} or rollout.server_token_file {path}")
            else:
                announced = f"token written to {path} (mode 0600): give trainers rollout.server_token_file {path}"
        server.server_activate()
        print(f"rollout server for {options.backbone} at http://{options.host}:{port}", flush=True)
        if announced:
            print(announced, flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
