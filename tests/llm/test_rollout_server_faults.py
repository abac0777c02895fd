"""The trainer checks what a rollout server gives it, and a server failing mid-run ends the fit with one line.

Hostile replies come from a proxy on 127.0.0.1 in front of a real ``flowkit rollout-server`` (the weight push goes
through to it; its ``/generate`` replies are rewritten on the way back): a policy version the trainer never pushed,
rows longer than ``max_new_tokens``, a token id outside the vocabulary, a reply padded by 600 MB. A model whose config
differs only in ``rope_theta`` is refused at connect; a reply dripped a byte at a time fails at the request's bound.
A server killed or stopped mid-run ends ``flowkit fit`` with one line naming its address (exit 2, no traceback)."""

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from flowkit.errors import ConfigError
from flowkit.llm.backbone import load_backbone
from flowkit.llm.server_engine import ServerError, ServerRolloutEngine

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from loopback_server import LoopbackHTTP  # noqa: E402
from rollout_server_process import RolloutServer  # noqa: E402

PROMPTS = ["47+38=", "12+13=", "9+9=", "61+25="]
TIMEOUT_S = 20.0
PADDING_MB = 600
HOP_BY_HOP = {"host", "content-length", "connection"}


def send(handler: BaseHTTPRequestHandler, status: int, data: bytes, length: int | None = None) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data) if length is None else length))
    handler.end_headers()
    handler.wfile.write(data)


class TamperingProxy(LoopbackHTTP):
    """An address on 127.0.0.1 in front of the server at ``upstream``: every request goes through to it with its
    headers, and the client gets its answer, but a ``/generate`` reply goes to ``answer(handler, reply)``, which sends
    what the client gets instead. ``sent``: the bytes ``answer`` managed to send."""

    def __init__(self, upstream: str, answer):
        self.answer, self.sent = answer, 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                headers = {key: value for key, value in self.headers.items() if key.lower() not in HOP_BY_HOP}
                request = urllib.request.Request(upstream + self.path, data=self.rfile.read(length) if length else None,
                                                 method=method, headers=headers)
                try:
                    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                        status, data = response.status, response.read()
                except urllib.error.HTTPError as err:
                    status, data = err.code, err.read()
                try:
                    if self.path == "/generate" and status == 200:
                        proxy.answer(self, json.loads(data))
                    else:
                        send(self, status, data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the trainer refused the answer and hung up

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

            def log_message(self, *args):
                pass

        self._serve(Handler)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = RolloutServer(tmp_path_factory.mktemp("server") / "server.log", TIMEOUT_S)
    yield running
    running.kill()


@pytest.fixture(scope="module")
def tiny():
    return load_backbone("bundled:tiny_adder")


def generate_through(server: RolloutServer, tiny, answer) -> None:
    """Push the tiny policy to ``server`` and generate the prompts greedily, ``answer`` rewriting the reply."""
    model, tokenizer = tiny
    with TamperingProxy(server.url, answer) as proxy:
        engine = ServerRolloutEngine(model, tokenizer, proxy.url, timeout_s=TIMEOUT_S, max_new_tokens=24)
        try:
            engine.generate(PROMPTS, n=2, temperature=0)
        finally:
            engine.close()


def as_json(handler, reply):
    send(handler, 200, json.dumps(reply).encode())


def test_the_untampered_proxy_generates(server, tiny, single_thread):
    """The proxy itself changes nothing: the tests below fail for what their ``answer`` does only."""
    generate_through(server, tiny, as_json)


@pytest.mark.parametrize("version", [10**9, -1])
def test_a_version_the_trainer_never_pushed_is_one_line(server, tiny, single_thread, version):
    with pytest.raises(ServerError, match=rf"^rollout server at http://127.0.0.1:\d+: /generate answered policy "
                                          rf"version {version}, not one the trainer pushed from version 0 \(asked "
                                          r"for\) to 0$"):
        generate_through(server, tiny, lambda handler, reply: as_json(handler, {**reply, "version": version}))


def test_rows_longer_than_max_new_tokens_are_one_line(server, tiny, single_thread):
    def long_rows(handler, reply):
        reply["tokens"][1] = (reply["tokens"][1] * 464)[:464]
        reply["logprobs"][1] = (reply["logprobs"][1] * 464)[:464]
        as_json(handler, reply)

    with pytest.raises(ServerError, match=r": /generate row 1 has 464 response tokens, more than max_new_tokens "
                                          r"24$"):
        generate_through(server, tiny, long_rows)


@pytest.mark.parametrize("token", [25, -1, 3.0, None])
def test_a_token_id_outside_the_vocabulary_is_one_line(server, tiny, single_thread, token):
    def outside(handler, reply):
        reply["tokens"][2][0] = token
        as_json(handler, reply)

    with pytest.raises(ServerError, match=rf": /generate row 2 has token id {re.escape(repr(token))}, outside the "
                                          r"vocabulary \(0 … 24\)$"):
        generate_through(server, tiny, outside)


@pytest.mark.parametrize("versions", [[0, 1], [0, 0, 0], "0"], ids=["never-pushed", "one-too-many", "not-a-list"])
def test_token_versions_the_trainer_never_pushed_are_one_line(server, tiny, single_thread, versions):
    """Each token's policy version (partial rollouts: a push lands mid-row) is one the trainer pushed, one per token;
    version 1 was never pushed here (the trainer pushed 0)."""
    def relabelled(handler, reply):
        reply["tokens"][1], reply["logprobs"][1] = reply["tokens"][1][:2], reply["logprobs"][1][:2]
        reply["token_versions"][1] = versions
        as_json(handler, reply)

    with pytest.raises(ServerError, match=r": /generate row 1 has no policy version per token, each one the trainer "
                                          r"pushed, from the reply's 0 on and never going back$"):
        generate_through(server, tiny, relabelled)


@pytest.mark.parametrize("declared", [True, False])
def test_a_reply_padded_by_600_mb_is_refused_after_reading_its_bound(server, tiny, single_thread, declared):
    """The reply's bound here is about 1 MB (4 prompts × 2 rows of at most 24 tokens): a reply that declares 600 MB
    is refused unread; one that sends them without a length is refused once past its bound, and the server's writes
    fail soon after (what the kernel's socket buffers take), never the 600 MB."""
    sent = []

    def padded(handler, reply):
        data = json.dumps(reply).encode()
        handler.send_response(200)
        if declared:
            handler.send_header("Content-Length", str((PADDING_MB << 20) + len(data)))
        handler.end_headers()  # no length: the reply ends where the connection does
        chunk, count = b" " * (1 << 20), 0
        try:
            for _ in range(PADDING_MB):
                handler.wfile.write(chunk)
                count += len(chunk)
            handler.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            sent.append(count)

    with pytest.raises(ServerError, match=r": /generate sent a reply (of \d+ bytes, )?over its bound of \d+ bytes$"):
        generate_through(server, tiny, padded)
    deadline = time.monotonic() + 60
    while not sent and time.monotonic() < deadline:  # the proxy's handler sees the trainer hang up
        time.sleep(0.05)
    assert sent and sent[0] < 64 << 20, sent


def test_a_model_differing_only_in_rope_theta_is_one_line_at_connect(server):
    """Qwen2.5-7B and Qwen2.5-Math-7B differ so: the server's model has rope_theta 1e4, the trainer's 1e6."""
    model, tokenizer = load_backbone("bundled:tiny_adder")
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_theta": 1e6}
    with pytest.raises(ConfigError, match=rf"^rollout server at {server.url} serves another model \(bundled:tiny_adder: "
                                          r"rope_parameters.rope_theta 10000.0 \(trainer: 1000000.0\)\)$"):
        ServerRolloutEngine(model, tokenizer, server.url, timeout_s=TIMEOUT_S)


def test_a_reply_dripped_a_byte_every_2_s_fails_at_the_requests_bound(tiny):
    """Each byte comes well within the 3 s bound, so a bound per socket read would wait for all of them (a minute);
    the bound on the whole request ends it after the first byte or two."""
    body = json.dumps({"instance": "x" * 16}).encode()
    dripped, hung_up = [], threading.Event()

    class Dripping(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                for byte in body:
                    if hung_up.wait(2.0):
                        break
                    self.wfile.write(bytes([byte]))
                    dripped.append(byte)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Dripping)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(ConfigError, match=rf"^rollout server at {url}: no answer to /info within 3 s$"):
            ServerRolloutEngine(*tiny, url, timeout_s=3.0)
        count = len(dripped)
    finally:
        hung_up.set()
        httpd.shutdown()
        httpd.server_close()
    assert 1 <= count <= 3, count  # each of them 2 s apart: the request ended near its 3 s, not at the last


def stopped(process: subprocess.Popen) -> bool:
    return Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
def test_a_server_killed_or_stopped_mid_run_ends_flowkit_fit_with_one_line_naming_it(signal_name, tmp_path):
    """``flowkit fit`` against a real server, which is SIGKILLed or SIGSTOPped (a hung server or host: its sockets
    stay open, so only the trainer's bound ends the wait) after policy version 2 landed: the fit exits 2 with one
    ``error:`` line naming the server's address and no traceback, within its bound (10 s) and some slack."""
    import rlfr_run

    timeout_s = 10.0
    server = RolloutServer(tmp_path / "server.log", timeout_s)
    (tmp_path / "run").mkdir()
    trainer = subprocess.Popen(
        rlfr_run.command(tmp_path / "run", 200, "--model.init_args.sampling.num_samples", "2",
                         "--model.init_args.sampling.max_new_tokens", "24", "--model.init_args.rollout.engine", "server",
                         "--model.init_args.rollout.server_url", server.url,
                         "--model.init_args.rollout.server_timeout", str(timeout_s)),
        env=rlfr_run.env(), cwd=tmp_path / "run", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while "policy version 2 loaded" not in server.log.read_text():
            assert trainer.poll() is None and time.monotonic() < deadline, server.log.read_text()[-2000:]
            time.sleep(0.2)
        server.process.send_signal(getattr(signal, signal_name))
        signalled = time.monotonic()
        _, stderr = trainer.communicate(timeout=timeout_s + 120)
        ended = time.monotonic()
    finally:
        server.kill()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(timeout=30)
    assert trainer.returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: rollout server at {server.url}: "), stderr[-3000:]
    assert ended - signalled < timeout_s + 60, (ended - signalled, errors)


def test_a_version_the_server_invents_ends_flowkit_fit_with_one_line(server, tmp_path):
    """Through ``flowkit fit``: the run used to train on a reply claiming version 10⁹ and exit 0."""
    import rlfr_run

    with TamperingProxy(server.url, lambda handler, reply: as_json(handler, {**reply, "version": 10**9})) as proxy:
        (tmp_path / "run").mkdir()
        result = subprocess.run(
            rlfr_run.command(tmp_path / "run", 2, "--model.init_args.sampling.max_new_tokens", "24",
                             "--model.init_args.rollout.engine", "server", "--model.init_args.rollout.server_url",
                             proxy.url, "--model.init_args.rollout.server_timeout", str(TIMEOUT_S)),
            env=rlfr_run.env(), cwd=tmp_path / "run", capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: rollout server at {proxy.url}: /generate answered policy version 1000000000, not one "
                      "the trainer pushed from version 0 (asked for) to 0"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("holds", ["what was pushed", "it in bfloat16", "another norm"])
def test_a_server_that_does_not_hold_what_it_acknowledged_is_refused_by_weight_digests(holds):
    """Trainer and server ends of a gloo channel in two threads: after the push the server reports the digests of
    the first and the last norm weight as its model holds them (here: a copy of what arrived, cast to its dtype, or
    with the last norm changed), and the trainer compares them with what it pushed."""
    from flowkit.llm.server_engine import WeightChannel, sampled_on_the_way, weight_buckets

    torch.manual_seed(0)
    weights = [("layers.0.norm.weight", torch.randn(8)), ("proj.weight", torch.randn(8, 8)),
               ("proj.bias", torch.randn(8)), ("norm.weight", torch.randn(8))]
    store = WeightChannel.host_store("127.0.0.1", TIMEOUT_S)
    model: dict[str, torch.Tensor] = {}

    def held(name):
        tensor = model[name].to(torch.bfloat16) if holds == "it in bfloat16" else model[name]
        return tensor + 1 if holds == "another norm" and name == "norm.weight" else tensor

    def server_end():
        channel = WeightChannel(WeightChannel.join_store("127.0.0.1", store.port, TIMEOUT_S), 1, TIMEOUT_S,
                                torch.device("cpu"))
        channel.receive(lambda stream: sum(model.setdefault(name, tensor.clone()) is not None
                                           for name, tensor in stream), held)

    thread = threading.Thread(target=server_end)
    thread.start()
    trainer_end = WeightChannel(store, 0, TIMEOUT_S, torch.device("cpu"))
    sampled: dict[str, torch.Tensor] = {}
    for bucket, last in weight_buckets(sampled_on_the_way(iter(weights), sampled), 1 << 20):
        trainer_end.send_bucket(bucket, 3, last)
    try:
        if holds == "another norm":
            with pytest.raises(RuntimeError, match=r"^the server holds other values for norm\.weight than version 3 "):
                trainer_end.acknowledgement(3, sampled)
        else:
            assert trainer_end.acknowledgement(3, sampled) == 4
    finally:
        thread.join(timeout=TIMEOUT_S)
    assert sorted(sampled) == ["layers.0.norm.weight", "norm.weight"]  # not the bias
