"""A ``flowkit rollout-server`` subprocess on 127.0.0.1 for the server engine's tests (tests/llm/test_rollout_server.py):
tests import it by module name, as ``tests/`` is on ``sys.path``."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flowkit.llm.server_protocol import TOKEN_ENV

ROOT = Path(__file__).resolve().parent.parent
STARTUP_S = 300  # loading the tiny backbone in a fresh interpreter (vLLM: building its engine), on loaded CI cores
HAS_VLLM = importlib.util.find_spec("vllm") is not None
BACKENDS = ["hf", pytest.param("vllm", marks=[pytest.mark.vllm,
                                              pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")])]
"""Both server backends, for ``parametrize``: the vLLM one runs in the vLLM venv only (``-m vllm``, .ci/run)."""
os.environ[TOKEN_ENV] = os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
TOKEN = os.environ[TOKEN_ENV]
"""The secret of the test session's servers, in the environment that they, the trainers built in this process and
the trainer subprocesses (which inherit it) read it from."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RolloutServer:
    """A ``flowkit rollout-server --backend BACKEND --tensor-parallel-size N *EXTRA`` subprocess serving ``backbone``
    (default bundled:tiny_adder) on ``port`` (default: a free one; this interpreter's ``flowkit``: the vLLM venv's
    under its tests), with the session's :data:`TOKEN` (None: none, so that it generates its own)."""

    def __init__(self, log: Path, timeout_s: float, backend: str = "hf", port: int | None = None,
                 tensor_parallel_size: int = 1, extra: tuple[str, ...] = (), token: str | None = TOKEN,
                 backbone: str = "bundled:tiny_adder"):
        self.backend, self.port = backend, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               "OMP_NUM_THREADS": "1", "XDG_RUNTIME_DIR": str(log.parent)}  # where a token it generates goes
        if token is None:
            del env[TOKEN_ENV]
        flowkit = str(Path(sys.executable).parent / "flowkit")
        self.log = log
        self.process = subprocess.Popen([flowkit, "rollout-server", "--backbone", backbone, "--backend",
                                         backend, "--host", "127.0.0.1", "--port", str(self.port), "--timeout",
                                         str(timeout_s), "--tensor-parallel-size", str(tensor_parallel_size),
                                         *extra],
                                        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_S
        while "rollout server for" not in log.read_text():
            assert self.process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the server did not start within {STARTUP_S} s"
            time.sleep(0.2)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)


def served_greedy(url: str, prompts: list[str], version: int, max_new_tokens: int, timeout_s: float) -> list[list[int]]:
    """The server's greedy response tokens, asked over its HTTP API directly (an engine would push its own weights
    first), once it holds ``version``."""
    body = {"prompts": prompts, "n": 1, "temperature": 0, "top_p": 1.0, "max_new_tokens": max_new_tokens, "seed": 0,
            "min_version": version, "wait_s": timeout_s}
    request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        reply = json.loads(response.read())
    assert reply["version"] == version
    return reply["tokens"]
