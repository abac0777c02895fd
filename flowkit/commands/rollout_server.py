"""`flowkit rollout-server`: generation in its own process, on its own devices, for trainers with
``rollout_engine: server`` (:mod:`flowkit.llm.server_engine`).

It loads its own copy of the backbone and serves, over HTTP with JSON (stdlib only)::

    GET  /info              model name, identity (architecture, hidden size, layers, vocabulary), policy version
    POST /generate          {prompts, n, temperature, top_p, max_new_tokens, rollout_batch_size, seed, min_version,
                             wait_s}
                            → per row: response token ids and sampler log-probs; the policy version they came from
    POST /weights/connect   {host, port, device}: join the trainer's weight channel (a TCPStore + gloo / NCCL group)
                            → the device it moves tensors on (cuda: NCCL, both sides on GPUs; cpu: gloo)
    POST /weights           {version}: receive one push on that channel (buckets), then load it

Generation runs flowkit's HF decoding loop (:class:`flowkit.llm.hf_engine.HFRolloutEngine`) on the server's model;
a push waits for the generation in flight and generations wait for a push in progress (one lock), so every reply
comes from one policy version. Every answer carries the server's ``instance`` id: a trainer notices a restart.
Start it before the trainer::

    flowkit rollout-server --backbone Qwen/Qwen2.5-Math-7B --dtype bfloat16 --host 0.0.0.0 --port 8000
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from flowkit.llm.backbone import load_backbone
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.server_engine import WeightChannel, model_identity, response_rows
from flowkit.registry import standalone

log = logging.getLogger(__name__)


class RolloutService:
    """The server's state: its model and HF engine, the policy version it holds, the weight channel, one lock."""

    def __init__(self, backbone: str, dtype: str, device: str, timeout_s: float):
        self.backbone, self.timeout_s = backbone, timeout_s
        self.device = torch.device(device)
        model, self.tokenizer = load_backbone(backbone, dtype)
        self.model = model.to(self.device).eval()
        self.engine = HFRolloutEngine(self.model, self.tokenizer)
        self.parameters = dict(self.model.named_parameters(remove_duplicate=False))  # tied: both names are pushed
        self.instance = uuid.uuid4().hex
        self.version = 0
        self.channel: WeightChannel | None = None
        self.joined = threading.Event()  # set once a trainer's channel is formed (or failed to form)
        self.ready = threading.Condition()  # guards the model and the version; notified when a push lands

    def info(self) -> dict:
        return {"model": self.backbone, "identity": model_identity(self.model, self.tokenizer), "version": self.version}

    def generate(self, request: dict) -> dict:
        with self.ready:
            if not self.ready.wait_for(lambda: self.version >= request["min_version"], timeout=request["wait_s"]):
                raise TimeoutError(f"holds policy version {self.version}; version {request['min_version']} was not "
                                   f"pushed within {request['wait_s']:g} s")
            started = time.time()
            engine = self.engine
            engine.max_new_tokens, engine.top_p = request["max_new_tokens"], request["top_p"]
            engine.rollout_batch_size = request.get("rollout_batch_size")
            if request["temperature"] > 0:
                torch.manual_seed(request["seed"])
            prompts = request["prompts"]
            batch = engine.generate(prompts, request["n"], temperature=request["temperature"])
            encoded = self.tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
            rows = list(response_rows(batch, encoded["input_ids"].shape[1]))
            return {"prompt_ids": [row[mask.bool()].tolist() for row, mask in
                                   zip(encoded["input_ids"], encoded["attention_mask"])],
                    "tokens": [tokens for tokens, _ in rows], "logprobs": [logprobs for _, logprobs in rows],
                    "nonfinite": engine.saw_nonfinite_logits, "version": self.version,
                    "started": started, "finished": time.time()}

    def connect(self, request: dict) -> dict:
        """Join the trainer's store and group in the background: the trainer forms its side after this answer."""
        store = WeightChannel.join_store(request["host"], request["port"], self.timeout_s)
        device = self.device if request["device"] == "cuda" and self.device.type == "cuda" else torch.device("cpu")
        self.channel = None
        self.joined = joined = threading.Event()

        def join() -> None:
            try:
                self.channel = WeightChannel(store, 1, self.timeout_s, device)
            except RuntimeError as err:
                log.error("weight channel to %s:%s not formed: %s", request["host"], request["port"], err)
            joined.set()

        threading.Thread(target=join, daemon=True).start()
        return {"device": device.type}

    def receive_weights(self, version: int) -> None:
        """Receive a push in the background (the trainer sends after this answer), holding the model meanwhile."""
        def receive() -> None:
            if not self.joined.wait(self.timeout_s) or self.channel is None:
                log.error("push of version %d: no weight channel", version)
                return
            with self.ready:
                try:
                    received, loaded = self.channel.receive(self._load)
                except RuntimeError as err:  # the trainer gone or past the timeout: its weights are incomplete
                    log.error("push of version %d failed: %s", version, err)
                    self.channel = None
                    return
                self.version = received
                self.ready.notify_all()
            log.info("policy version %d loaded (%d tensors)", received, loaded)

        threading.Thread(target=receive, daemon=True).start()

    def _load(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy a pushed weight into the model; False (not loaded, the trainer reports it) for a name or shape
        the model does not have."""
        parameter = self.parameters.get(name)
        if parameter is None or parameter.shape != tensor.shape:
            log.error("pushed weight %s %s is not one of %s's", name, tuple(tensor.shape), self.backbone)
            return False
        with torch.no_grad():
            parameter.copy_(tensor)
        return True


def make_server(service: RolloutService, host: str, port: int) -> ThreadingHTTPServer:
    routes = {("GET", "/info"): lambda body: service.info(),
              ("POST", "/generate"): service.generate,
              ("POST", "/weights/connect"): service.connect,
              ("POST", "/weights"): lambda body: service.receive_weights(body["version"]) or {}}

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
    """serve rollout generation over HTTP for `rollout_engine: server` trainers: flowkit rollout-server --backbone
    MODEL --port N"""
    parser = argparse.ArgumentParser(prog="flowkit rollout-server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", required=True, help="hub id, local dir or bundled:tiny_adder (the trainer's)")
    parser.add_argument("--dtype", default="float32", help="parameter dtype (bfloat16 for real models)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: one the OS picks, printed)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model runs (default: the GPU if there is one)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any wait on a trainer may take")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    service = RolloutService(options.backbone, options.dtype, options.device, options.timeout)
    server = make_server(service, options.host, options.port)
    print(f"rollout server for {options.backbone} at http://{options.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
