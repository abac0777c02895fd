"""``flowkit rollout-server`` against a neighbour (docs/security.md): real server processes on 127.0.0.1, a second
process as the intruder (tests/rollout_intruder.py). Without the secret nothing is served; with it, a second run
cannot take the weight channel from a live one, nor push without holding it; the connect dials only the host the
request came from; a push that fails part way, however, serves nothing until a whole one; and the server's own
limits (body size, rows × tokens, connections, read deadlines, malformed fields, arguments) are one line each."""

import json
import math
import os
import re
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from flowkit.errors import ConfigError
from flowkit.llm.backbone import load_backbone
from flowkit.llm.server_engine import ServerRolloutEngine, WeightChannel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from rollout_server_process import STARTUP_S, TOKEN, RolloutServer  # noqa: E402

TIMEOUT_S = 20.0
PROMPTS = ["47+38=", "12+13="]
GENERATE = {"prompts": PROMPTS, "n": 1, "temperature": 0, "top_p": 1.0, "max_new_tokens": 4, "seed": 0,
            "min_version": 0, "wait_s": 5}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server with the session's token and its default limits and lease."""
    server = RolloutServer(tmp_path_factory.mktemp("guarded") / "server.log", TIMEOUT_S)
    yield server
    server.kill()


@pytest.fixture(scope="module")
def trainer_run(guarded):
    """One trainer run holding ``guarded``'s weight channel: its engine (a short timeout: the torn push waits it
    out) and policy."""
    model, tokenizer = load_backbone("bundled:tiny_adder")
    engine = ServerRolloutEngine(model, tokenizer, guarded.url, timeout_s=8.0, max_new_tokens=4, bucket_mb=1)
    engine.sync_weights(model, 0)
    return engine, model


def call(url: str, method: str, path: str, body=None, token: str | None = TOKEN, run: str | None = None,
         data: bytes | None = None, timeout: float = 60) -> tuple[int, dict]:
    """One request; its status and JSON reply, errors included."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if run is not None:
        headers["Flowkit-Run"] = run
    if data is None and body is not None:
        data = json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def intruder(url: str, action: str, *options: str) -> dict:
    """tests/rollout_intruder.py in a process of its own, without the session's token in its environment."""
    env = {key: value for key, value in os.environ.items() if key != "FLOWKIT_SERVER_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "rollout_intruder.py"), url, action, *options],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def threads(process: subprocess.Popen) -> int:
    status = Path(f"/proc/{process.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def one_line_error(reply: dict) -> str:
    assert "\n" not in reply["error"] and reply["error"], reply
    return reply["error"]


def test_without_the_token_every_endpoint_is_refused_and_a_neighbours_push_loads_nothing(guarded):
    for method, path, body in [("GET", "/info", None), ("POST", "/generate", GENERATE),
                               ("POST", "/weights/connect", {"port": 1, "device": "cpu"}),
                               ("POST", "/weights", {"version": 1}), ("GET", "/no-such-route", None)]:
        for token in (None, "not-" + TOKEN, TOKEN[:-1]):
            status, reply = call(guarded.url, method, path, body, token=token, run="intruder")
            assert status == 401 and "token" in one_line_error(reply), (method, path, reply)
    pushed = intruder(guarded.url, "push")  # its own store, connect, version 999999, zeroed weights
    assert pushed["connect"]["status"] == pushed["weights"]["status"] == 401 and "acknowledged" not in pushed
    assert call(guarded.url, "GET", "/info")[1]["version"] != 999999
    assert "999999" not in guarded.log.read_text()


def test_a_second_run_with_the_token_can_neither_take_the_channel_nor_push_while_the_first_lives(guarded,
                                                                                                 trainer_run):
    engine, model = trainer_run
    version = engine.pushed_version + 1
    taken = intruder(guarded.url, "push", "--token", TOKEN)
    assert taken["connect"]["status"] == 409 and "held by trainer run" in one_line_error(taken["connect"])
    assert taken["weights"]["status"] == 409 and "acknowledged" not in taken
    engine.sync_weights(model, version)  # the run's next push goes through
    assert engine.pushed_version == version and engine.last_push.loaded == engine.last_push.sent
    assert bool(engine.generate(PROMPTS, 1, temperature=0).policy_versions.eq(version).all())
    assert "999999" not in guarded.log.read_text()


def test_post_weights_without_the_channel_is_refused_without_holding_the_model(guarded, trainer_run):
    pushed = intruder(guarded.url, "weights", "--token", TOKEN, "--run", "another-run")
    assert pushed["weights"]["status"] == 409 and "does not hold the weight channel" in pushed["weights"]["error"]
    status, reply = call(guarded.url, "POST", "/generate", {**GENERATE, "wait_s": 1}, timeout=TIMEOUT_S)
    assert status == 200 and len(reply["tokens"]) == 2  # no push is waited for with the model held


def test_the_connect_dials_only_the_requesting_host_and_a_port_without_a_store_is_refused_in_bounds(guarded,
                                                                                                  trainer_run):
    """The run holding the channel (another would be refused before any dialing) names a port on which something
    listens that is no store, and another host in the body: the server dials the request's own host, and answers
    within its timeout, each handler thread ending with its answer."""
    with socket.socket() as silent:  # accepts connections and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        before = threads(guarded.process)
        for _ in range(2):  # twice: the handler threads must not pile up
            status, reply = call(guarded.url, "POST", "/weights/connect",
                                 {"host": "192.0.2.1", "port": port, "device": "cpu"}, run=trainer_run[0].run,
                                 timeout=TIMEOUT_S + 30)
            assert status == 400 and one_line_error(reply).startswith(f"no weight-channel store at 127.0.0.1:{port}")
    deadline = time.monotonic() + 30
    while threads(guarded.process) > before and time.monotonic() < deadline:  # handler threads end as they answer
        time.sleep(0.2)
    assert threads(guarded.process) <= before


def test_the_trainers_store_listens_on_the_interface_it_reaches_the_server_through():
    store = WeightChannel.host_store("127.0.0.1", TIMEOUT_S)
    listening = [line.split()[1] for name in ("tcp", "tcp6") for line in Path(f"/proc/net/{name}").read_text()
                 .splitlines()[1:] if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == store.port]
    assert listening == [f"0100007F:{store.port:04X}"]  # 127.0.0.1 only, not 0.0.0.0 nor [::]


def test_a_push_failing_part_way_with_an_unexpected_error_serves_no_version_until_a_whole_one(guarded, trainer_run,
                                                                                              monkeypatch):
    """The second bucket of a push names a dtype torch does not have (the server's parse raises AttributeError, a
    type its push handling never expected): the first bucket is loaded, so the model is torn; no version is served
    until the next whole push, which the same run makes over a new channel."""
    engine, model = trainer_run
    torn, whole = engine.pushed_version + 1, engine.pushed_version + 2
    send_json, headers = WeightChannel._send_json, []

    def corrupting(channel, value):
        if value.get("version") == torn and "entries" in value:
            headers.append(value)
            if len(headers) == 2:
                value = {**value, "entries": [[name, "float7", *rest] for name, _, *rest in value["entries"]]}
        send_json(channel, value)

    monkeypatch.setattr(WeightChannel, "_send_json", corrupting)
    with pytest.raises(RuntimeError, match=rf"^rollout server at {guarded.url}: weight push of version {torn} "
                                           "failed") as err:
        engine.sync_weights(model, torn)
    assert "\n" not in str(err.value) and len(headers) >= 2
    log = guarded.log.read_text()
    assert f"push of version {torn} failed: AttributeError" in log
    status, reply = call(guarded.url, "POST", "/generate", {**GENERATE, "wait_s": 1})
    assert status == 503 and "holds policy version -1" in reply["error"]
    monkeypatch.setattr(WeightChannel, "_send_json", send_json)
    engine.sync_weights(model, whole)
    assert bool(engine.generate(PROMPTS, 1, temperature=0).policy_versions.eq(whole).all())


def test_a_run_silent_past_its_lease_loses_the_channel_and_learns_it_in_one_line(tmp_path):
    server = RolloutServer(tmp_path / "server.log", TIMEOUT_S, extra=("--lease", "2"))
    try:
        model, tokenizer = load_backbone("bundled:tiny_adder")
        engine = ServerRolloutEngine(model, tokenizer, server.url, timeout_s=TIMEOUT_S, max_new_tokens=4)
        engine.sync_weights(model, 0)
        time.sleep(3)  # past the lease, with no request from the run
        taken = intruder(server.url, "connect", "--token", TOKEN)
        assert taken["connect"]["status"] == 200
        with pytest.raises(RuntimeError, match=rf"^rollout server at {server.url}'s weight channel was taken by "
                                               r"another trainer run \(intruder; ") as err:
            engine.generate(PROMPTS, 1, temperature=0)
    finally:
        server.kill()
    assert "\n" not in str(err.value)


def test_a_generated_token_is_written_for_this_user_only_and_required(tmp_path):
    server = RolloutServer(tmp_path / "server.log", TIMEOUT_S, token=None)
    try:
        announced = next(line for line in server.log.read_text().splitlines() if line.startswith("token written"))
        path = Path(announced.split(" to ", 1)[1].split(" (mode", 1)[0])
        assert path.parent == tmp_path / "flowkit" and path.stat().st_mode & 0o777 == 0o600
        assert path.read_text().strip() not in server.log.read_text()  # the secret itself is never printed
        model, tokenizer = load_backbone("bundled:tiny_adder")
        engine = ServerRolloutEngine(model, tokenizer, server.url, timeout_s=TIMEOUT_S, token_file=str(path))
        assert engine.servers[0].instance
        with pytest.raises(ConfigError, match=rf"^rollout server at {server.url}: /info failed \(401: no or wrong "
                                              "token") as err:
            ServerRolloutEngine(model, tokenizer, server.url, timeout_s=TIMEOUT_S)  # the session's token: not it
    finally:
        server.kill()
    assert "\n" not in str(err.value)


def test_a_generated_token_is_printed_once_on_a_terminal(tmp_path):
    """Standard output a terminal (a pseudo-terminal here): the token itself is printed with its file, once."""
    import pty

    from flowkit.llm.server_protocol import TOKEN_ENV

    controller, terminal = pty.openpty()
    env = {key: value for key, value in os.environ.items() if key != TOKEN_ENV}
    process = subprocess.Popen([str(Path(sys.executable).parent / "flowkit"), "rollout-server", "--backbone",
                                "bundled:tiny_adder", "--host", "127.0.0.1", "--port", "0"],
                               env={**env, "XDG_RUNTIME_DIR": str(tmp_path)}, stdout=terminal,
                               stderr=subprocess.DEVNULL)
    os.close(terminal)
    printed = b""
    try:
        deadline = time.monotonic() + STARTUP_S
        while b"rollout.server_token_file" not in printed and time.monotonic() < deadline:
            if select.select([controller], [], [], 1)[0]:
                printed += os.read(controller, 4096)
    finally:
        process.kill()
        process.wait(timeout=30)
        os.close(controller)
    [path] = tmp_path.glob("flowkit/rollout-server-*.token")
    lines = [line for line in printed.decode().splitlines() if line.startswith("token ")]
    assert lines == [f"token {path.read_text().strip()} (also in {path}, mode 0600): give trainers this token in "
                     f"{TOKEN_ENV} or rollout.server_token_file {path}"]


def test_insecure_no_auth_on_loopback_serves_without_a_token(tmp_path):
    server = RolloutServer(tmp_path / "server.log", TIMEOUT_S, token=None, extra=("--insecure-no-auth",))
    try:
        status, reply = call(server.url, "GET", "/info", token=None)
    finally:
        server.kill()
    assert status == 200 and reply["model"] == "bundled:tiny_adder"
    assert not (tmp_path / "flowkit").exists() and "token written" not in server.log.read_text()


def test_a_one_gib_body_is_refused_from_its_length_unread(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=TIMEOUT_S) as connection:
        connection.sendall(f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                           f"Content-Type: application/json\r\nContent-Length: {2**30}\r\n\r\n".encode())
        answer = b""
        while chunk := connection.recv(65536):  # the server answers and closes, without waiting for the body
            answer += chunk
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.0 413")
    assert one_line_error(json.loads(body)) == f"a body of {2**30} bytes is over this server's --max-body-mb " \
                                               f"({16 * 2**20} bytes)"


@pytest.mark.parametrize("change, message", [
    ({"n": 100000, "max_new_tokens": 1024}, r"^n × prompts × max_new_tokens = 100000 × 2 × 1024 = 204800000 is over "
                                            r"this server's --max-request-tokens 16777216"),
    ({"wait_s": math.nan}, r"^field 'wait_s' must be a finite number >= 0, got nan$"),
    ({"wait_s": math.inf}, r"^field 'wait_s' must be a finite number >= 0, got inf$"),
    ({"prompts": "47+38="}, r"^field 'prompts' must be a non-empty list of strings, got a string$"),
    ({"prompts": [47, 38]}, r"^field 'prompts' must be a non-empty list of strings$"),
    ({"n": "2"}, r"^field 'n' must be an integer >= 1, got a string$"),
    ({"n": 1.5}, r"^field 'n' must be an integer >= 1, got a number$"),
    ({"temperature": None}, r"^field 'temperature' must be a finite number >= 0, got null$"),
    ({"top_p": 0}, r"^field 'top_p' must be a finite number > 0 and <= 1, got 0.0$"),
    ({"seed": -1}, r"^field 'seed' must be an integer in \[0, 4294967295\], got -1$"),
    ({"min_version": True}, r"^field 'min_version' must be an integer >= 0, got a boolean$"),
    ({"max_new_tokens": None}, r"^field 'max_new_tokens' must be an integer >= 1, got null$"),
    ({"partial": 1}, r"^field 'partial' must be a boolean, got an integer$"),
])
def test_wrong_generation_fields_are_400_in_one_line(guarded, change, message):
    status, reply = call(guarded.url, "POST", "/generate", {**GENERATE, **change}, timeout=TIMEOUT_S)
    assert status == 400 and re.search(message, one_line_error(reply)), reply


@pytest.mark.parametrize("path, data, message", [
    ("/generate", b"[1, 2]", "the body must be a JSON object, got a list"),
    ("/generate", b"{\"prompts\": [", "the body is not JSON"),
    ("/generate", b"[" * 100000, "the body is not JSON"),
    ("/weights", b"{\"version\": \"1\"}", "field 'version' must be an integer >= 0, got a string"),
    ("/weights", b"{\"version\": 1, \"lora\": {\"layout\": {\"q\": {\"fan_in_fan_out\": 1}}}}",
     "lora.layout['q'].fan_in_fan_out must be a boolean"),
    ("/weights/connect", b"{\"port\": 70000, \"device\": \"cpu\"}", "field 'port' must be an integer in [1, 65535]"),
    ("/weights/connect", b"{\"port\": 1, \"device\": \"tpu\"}", "field 'device' must be 'cpu' or 'cuda'"),
])
def test_wrong_shaped_bodies_are_400_in_one_line(guarded, path, data, message):
    status, reply = call(guarded.url, "POST", path, data=data, run="some-run", timeout=TIMEOUT_S)
    assert status == 400 and one_line_error(reply).startswith(message), reply


def test_256_half_sent_requests_do_not_starve_info(tmp_path):
    """Every connection past ``--max-connections`` waits in the kernel's backlog, not in a thread, and each half-sent
    request is dropped at its read deadline: /info is answered, the threads stay bounded."""
    server = RolloutServer(tmp_path / "server.log", TIMEOUT_S, extra=("--max-connections", "32", "--read-timeout", "2"))
    half_sent = []
    try:
        idle = threads(server.process)
        for _ in range(256):
            connection = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S)
            connection.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n")
            half_sent.append(connection)
        most = threads(server.process)
        status, reply = call(server.url, "GET", "/info", timeout=120)
        assert status == 200 and reply["version"] == 0
        assert most <= idle + 32 + 2
    finally:
        for connection in half_sent:
            connection.close()
        server.kill()


@pytest.mark.parametrize("argv, message", [
    (["--timeout", "nan"], "argument --timeout: must be a finite number > 0, got 'nan'"),
    (["--port", "99999"], "argument --port: must be an integer >= 0 and <= 65535, got '99999'"),
    (["--gpu-memory-utilization", "2"], "argument --gpu-memory-utilization: must be a finite number > 0 and <= 1"),
    (["--dtype", "float7"], "--dtype must be one of"),
    (["--host", "0.0.0.0", "--insecure-no-auth"], "--insecure-no-auth serves anyone who reaches --host 0.0.0.0"),
    (["--token-file", "/nonexistent/token"], "--token-file /nonexistent/token: cannot read the token file"),
    (["--host", "192.0.2.1", "--port", "0"], "cannot listen on 192.0.2.1:0"),
])
def test_bad_arguments_are_one_line_before_any_model_loads(argv, message):
    done = subprocess.run([str(Path(sys.executable).parent / "flowkit"), "rollout-server", "--backbone",
                           "bundled:tiny_adder", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: flowkit rollout-server") and message in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
