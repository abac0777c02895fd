"""The HTTP side of ``flowkit rollout-server``: JSON routes behind the shared secret, with limits of its own.

Kept on the standard library's ``ThreadingHTTPServer`` (no dependency to install beside vLLM on a GPU image), with
what it lacks added here: at most ``max_connections`` connections are served at once (the others wait in the
kernel's backlog, not in a thread each), every request must arrive whole within ``read_timeout_s`` (a deadline on
the request, not on each read: a client that drips a byte a second is dropped at it), a body is refused from its
``Content-Length`` before it is read, and every answer, errors included, is one line of JSON.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from flowkit.llm.server_protocol import RUN_HEADER, RequestError, authorization

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """What a route is given: the parsed JSON body (``{}`` when there is none), the ``Flowkit-Run`` header (None:
    absent) and the address the request came from."""

    body: object
    run: str | None
    host: str


Route = Callable[[Request], dict]


@dataclass(frozen=True)
class Limits:
    """The server's bounds: ``--max-body-mb`` (in bytes), ``--max-connections``, ``--read-timeout``, and the
    ``--timeout`` a reply's writes get."""

    max_body_bytes: int
    max_connections: int
    read_timeout_s: float
    write_timeout_s: float


class _Deadline(io.RawIOBase):
    """A connection's reads, all of them within one deadline (the socket's own timeout bounds each read alone)."""

    def __init__(self, connection: socket.socket, deadline: float):
        self.connection, self.deadline = connection, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive whole within the read deadline")
        self.connection.settimeout(left)
        return self.connection.recv_into(buffer)


class RolloutHTTPServer(ThreadingHTTPServer):
    """Answers ``routes`` (``(method, path)`` → :data:`Route`) to requests that carry ``token`` (None: any request,
    ``--insecure-no-auth``), within ``limits``; every reply gets ``stamp()`` (the server's instance and the run
    holding its weight channel). Bound at construction, listening only after :meth:`server_activate`."""

    daemon_threads = True
    request_queue_size = 1024  # connections past max_connections wait here, in the kernel, for a free one

    def __init__(self, address: tuple[str, int], token: str | None, limits: Limits):
        super().__init__(address, _Handler, bind_and_activate=False)
        self.token, self.limits = token, limits
        self.routes: dict[tuple[str, str], Route] = {}
        self.stamp: Callable[[], dict] = dict
        self.slots = threading.BoundedSemaphore(limits.max_connections)
        self.server_bind()

    def process_request(self, request, client_address) -> None:
        self.slots.acquire()  # no more accepted (nor a thread started) until a connection in service ends
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: RolloutHTTPServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # read through the deadline instead
        self.rfile = io.BufferedReader(_Deadline(self.connection, time.monotonic() + self.server.limits.read_timeout_s))

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def _answer(self, method: str) -> None:
        try:
            reply = self._route(method)
            status = 200
        except RequestError as err:
            status, reply = err.status, {"error": str(err)}
        except TimeoutError as err:  # a request that waits for a version not pushed in time
            status, reply = 503, {"error": f"TimeoutError: {err}"}
        except Exception as err:  # whatever failed: one line to the client, the traceback in the log
            log.exception("%s %s failed", method, self.path)
            status, reply = 500, {"error": f"{type(err).__name__}: {_first_line(err)}"}
        self._send(status, {**reply, **self.server.stamp()})

    def _route(self, method: str) -> dict:
        token = self.server.token
        given = self.headers.get("Authorization", "").encode("latin-1", errors="replace")
        if token is not None and not hmac.compare_digest(given, authorization(token).encode()):
            raise RequestError("no or wrong token: send 'Authorization: Bearer <token>' with the server's token "
                               "(its --token-file or FLOWKIT_SERVER_TOKEN)", 401)
        route = self.server.routes.get((method, self.path))
        if route is None:
            raise RequestError(f"no route {method} {self.path}", 404)
        body = self._body()
        self.connection.settimeout(self.server.limits.write_timeout_s)  # the reply: a slow reader, bounded
        return route(Request(body, self.headers.get(RUN_HEADER), self.client_address[0]))

    def _body(self) -> object:
        declared = self.headers.get("Content-Length") or "0"
        if not declared.isdigit():
            raise RequestError(f"Content-Length must be a byte count, got {declared[:40]!r}")
        length, limit = int(declared), self.server.limits.max_body_bytes
        if length > limit:
            self.close_connection = True  # its body is not read
            raise RequestError(f"a body of {length} bytes is over this server's --max-body-mb ({limit} bytes)", 413)
        if not length:
            return {}
        try:
            data = self.rfile.read(length)
        except TimeoutError:
            raise RequestError("the body did not arrive within the read deadline", 408) from None
        if len(data) < length:
            raise RequestError(f"the body ended after {len(data)} of its {length} bytes")
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as err:
            raise RequestError(f"the body is not JSON ({_first_line(err)})") from None

    def _send(self, status: int, reply: dict) -> None:
        data = json.dumps(reply).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError as err:  # the client hung up, or reads slower than the write timeout
            log.debug("reply to %s not sent: %s", self.client_address[0], err)
            self.close_connection = True

    def log_message(self, format: str, *args) -> None:  # requests at debug level, not on stderr
        log.debug(format, *args)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
