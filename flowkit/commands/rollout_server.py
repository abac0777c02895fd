"""`flowkit rollout-server`: generation in its own process, on its own devices, for trainers with
``rollout.engine: server`` (:mod:`flowkit.llm.server_engine`).

It loads its own copy of the backbone and serves, over HTTP with JSON (stdlib only)::

    GET  /info              model name, identity (architecture, hidden size, layers, vocabulary), policy version
    POST /generate          {prompts, n, temperature, top_p, max_new_tokens, rollout_batch_size, seed, min_version,
                             wait_s}
                            → per row: response token ids and sampler log-probs; the policy version they came from
    POST /weights/connect   {host, port, device}: join the trainer's weight channel (a TCPStore + gloo / NCCL group),
                            abandoning a push still arriving on the earlier one (a trainer killed or hung mid-push)
                            → the device it moves tensors on (cuda: NCCL, both sides on GPUs; cpu: gloo)
    POST /weights           {version, lora}: receive one push on that channel (buckets), then load it; ``lora``
                            (``rollout.server_lora_push: adapter``): ``{layout}`` with the base weights and the
                            adapters, ``{layout: null}`` with the adapters alone, merged into the base kept from
                            the channel's first push (:class:`~flowkit.llm.server_backends.ServedAdapter`)

Generation runs on the server's own copy of the model (``--backend``, :mod:`flowkit.llm.server_backends`):
flowkit's HF decoding loop (``hf``, the default) or vLLM's in-process engine (``vllm``, built as the colocated
engine builds it; the pushed weights go through vLLM's loader). A push waits for the generation in flight and
generations wait for a push in progress (one lock), so every reply comes from one policy version; after a push that
failed part way none is served until the next whole one. Every answer carries the server's ``instance`` id: a
trainer notices a restart; every generation is a line of the log (rows, policy version, seconds). Start it before the
trainer::

    flowkit rollout-server --backbone Qwen/Qwen2.5-Math-7B --dtype bfloat16 --host 0.0.0.0 --port 8000 --backend vllm

Several servers (one per GPU, or per node) generate data parallel for one trainer, which lists their addresses in
``rollout.server_url``; each is a process of its own, started alike on its own device and port.
``--tensor-parallel-size N`` shards the vLLM backend's model over N GPUs (vLLM's tensor parallelism; its workers
then run in processes of their own, and pushes arrive over gloo, :class:`VllmServerBackend`).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from flowkit.errors import ConfigError
from flowkit.llm.server_backends import HFServerBackend, ServedAdapter, VllmServerBackend
from flowkit.llm.server_engine import WeightChannel, model_identity
from flowkit.llm.vllm_engine import seed_sampling
from flowkit.registry import standalone

log = logging.getLogger(__name__)

TORN = -1
"""The version after a push that failed part way (the model holds a mix of two versions): below every request's
``min_version``, so nothing is generated until the next whole push."""


class RolloutService:
    """The server's state: its backend (model and generator), the policy version it holds, the weight channel, one
    lock."""

    def __init__(self, backend: HFServerBackend | VllmServerBackend, backbone: str, timeout_s: float):
        self.backend, self.backbone, self.timeout_s = backend, backbone, timeout_s
        self.tokenizer = backend.tokenizer
        self.instance = uuid.uuid4().hex
        self.version = 0
        self.channel: WeightChannel | None = None
        self.adapter: ServedAdapter | None = None  # the base weights and adapters of a LoRA pushed as an adapter
        self.joined = threading.Event()  # set once a trainer's channel is formed (or failed to form)
        self.ready = threading.Condition()  # guards the model and the version; notified when a push lands

    def info(self) -> dict:
        return {"model": self.backbone, "identity": model_identity(self.backend.config, self.tokenizer),
                "version": self.version}

    def generate(self, request: dict) -> dict:
        with self.ready:
            if not self.ready.wait_for(lambda: self.version >= request["min_version"], timeout=request["wait_s"]):
                raise TimeoutError(f"holds policy version {self.version}; version {request['min_version']} was not "
                                   f"pushed within {request['wait_s']:g} s")
            started = time.time()
            if request["temperature"] > 0:
                seed_sampling(request["seed"])
            prompts = request["prompts"]
            rows, nonfinite = self.backend.generate(prompts, request["n"], request["temperature"], request["top_p"],
                                                    request["max_new_tokens"], request.get("rollout_batch_size"))
            encoded = self.tokenizer(prompts)
            log.info("generated %d rows (%d prompts × %d) from policy version %d in %.2f s", len(rows), len(prompts),
                     request["n"], self.version, time.time() - started)
            return {"prompt_ids": encoded["input_ids"], "tokens": [tokens for tokens, _ in rows],
                    "logprobs": [logprobs for _, logprobs in rows], "nonfinite": nonfinite, "version": self.version,
                    "started": started, "finished": time.time()}

    def connect(self, request: dict) -> dict:
        """Join the trainer's store and group in the background: the trainer forms its side after this answer. A
        trainer that connects takes the server over: a push still arriving on the earlier channel (a trainer killed
        or hung mid-push, now resumed) is abandoned at once instead of holding the model until its timeout."""
        store = WeightChannel.join_store(request["host"], request["port"], self.timeout_s)
        device = self.backend.device if request["device"] == "cuda" and self.backend.device.type == "cuda" \
            else torch.device("cpu")
        if self.channel is not None:
            self.channel.cancel()
        self.channel, self.adapter = None, None
        self.joined = joined = threading.Event()

        def join() -> None:
            try:
                channel = WeightChannel(store, 1, self.timeout_s, device, cancellable=True)
                if self.joined is joined:  # not superseded by a later connect meanwhile
                    self.channel = channel
            except RuntimeError as err:
                log.error("weight channel to %s:%s not formed: %s", request["host"], request["port"], err)
            joined.set()

        threading.Thread(target=join, daemon=True).start()
        return {"device": device.type}

    def receive_weights(self, version: int, lora: dict | None = None) -> None:
        """Receive a push in the background (the trainer sends after this answer), holding the model meanwhile. A
        push that fails part way leaves the model part old, part new: no version is served until a whole push."""
        def receive() -> None:
            if not self.joined.wait(self.timeout_s) or self.channel is None:
                log.error("push of version %d: no weight channel", version)
                return
            channel, failed = self.channel, False
            with self.ready:
                try:
                    received, loaded = channel.receive(self._loader(channel, version, lora), self.backend.held)
                except RuntimeError as err:  # the trainer gone, past the timeout, or superseded by another one
                    log.error("push of version %d failed: %s", version, err)
                    self.version, self.adapter, failed = TORN, None, True
                    if self.channel is channel:
                        self.channel = None
                else:
                    self.version = received
                    self.ready.notify_all()
            if failed:
                channel.close()  # outside the lock: a cancelled push's operation ends within its timeout
                return
            log.info("policy version %d loaded (%d tensors)", received, loaded)

        threading.Thread(target=receive, daemon=True).start()

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


def make_server(service: RolloutService, host: str, port: int) -> ThreadingHTTPServer:
    routes = {("GET", "/info"): lambda body: service.info(),
              ("POST", "/generate"): service.generate,
              ("POST", "/weights/connect"): service.connect,
              ("POST", "/weights"): lambda body: service.receive_weights(body["version"], body.get("lora")) or {}}

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            route = routes.get((method, self.path))
            status, reply = 200, None
            try:
                if route is None:
                    status, reply = 404, {"error": f"no route {method} {self.path}"}
                else:
                    length = int(self.headers.get("Content-Length") or 0)
                    reply = route(json.loads(self.rfile.read(length)) if length else {})
            except (TimeoutError, RuntimeError, KeyError, ValueError) as err:
                status, reply = 503 if isinstance(err, TimeoutError) else 400, {"error": f"{type(err).__name__}: {err}"}
            data = json.dumps({**reply, "instance": service.instance}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def log_message(self, format: str, *args) -> None:  # requests at debug level, not on stderr
            log.debug(format, *args)

    return ThreadingHTTPServer((host, port), Handler)


@standalone("rollout-server")
def rollout_server_command(argv: list[str]) -> None:
    """serve rollout generation over HTTP for `rollout.engine: server` trainers: flowkit rollout-server --backbone
    MODEL --port N"""
    parser = argparse.ArgumentParser(prog="flowkit rollout-server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", required=True, help="hub id, local dir or bundled:tiny_adder (the trainer's)")
    parser.add_argument("--dtype", default="float32", help="parameter dtype (bfloat16 for real models)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: one the OS picks, printed)")
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf",
                        help="what generates: flowkit's HF decoding loop, or vLLM's engine (pip install flowkit[vllm])")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the hf backend's model runs (default: the GPU if there is one; vllm: vLLM's own)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="vllm: share of the GPU's memory for weights and KV cache (CPU: VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="vllm: longest prompt + response its KV cache is planned for (default: the model's)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="vllm: GPUs (on CPU: worker processes) the model is sharded over, vLLM's tensor "
                             "parallelism")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any wait on a trainer may take")
    options = parser.parse_args(argv)
    if options.tensor_parallel_size < 1:
        raise ConfigError(f"flowkit rollout-server --tensor-parallel-size must be >= 1, got "
                          f"{options.tensor_parallel_size}")
    if options.tensor_parallel_size > 1 and options.backend != "vllm":
        raise ConfigError("flowkit rollout-server --tensor-parallel-size > 1 needs --backend vllm (the hf backend "
                          "runs one model on one device)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if options.backend == "vllm":
        backend = VllmServerBackend(options.backbone, options.dtype, options.gpu_memory_utilization,
                                    options.max_model_len, options.tensor_parallel_size)
    else:
        backend = HFServerBackend(options.backbone, options.dtype, options.device)
    service = RolloutService(backend, options.backbone, options.timeout)
    server = make_server(service, options.host, options.port)
    print(f"rollout server for {options.backbone} at http://{options.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
