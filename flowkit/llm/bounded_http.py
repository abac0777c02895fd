"""HTTP requests bounded as a whole: in time (a deadline for every send and receive of the request, not a timeout
per socket operation, which a reply dripped a byte at a time would never reach) and in the bytes read of the reply.

:func:`open_before` opens a :class:`urllib.request.Request` whose connection gives up at ``deadline``
(``time.monotonic()``), with :class:`TimeoutError`; :func:`read_at_most` reads a reply of at most ``limit`` bytes,
or raises :class:`ReplyTooLarge` having read no more than ``limit`` + 1 (never the whole of a larger one).
"""

from __future__ import annotations

import http.client
import io
import socket
import time
import urllib.request
from typing import Any, BinaryIO

_CHUNK = 1 << 16


class ReplyTooLarge(ValueError):
    """A reply over its size bound (its declared length, or what arrived past the bound)."""


class _DeadlineSocket:
    """A connected socket (plain or TLS) whose sends and receives wait at most until ``deadline``: before each, the
    socket's timeout is set to the time left. What ``http.client`` uses of a socket: ``sendall``, ``makefile``,
    ``close``."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline

    def bound(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self.sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self.bound()
        self.sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        self.sock.close()  # the socket stays open while a reader of its own is (the socket module counts them)


class _DeadlineReader(io.RawIOBase):
    def __init__(self, owner: _DeadlineSocket):
        self.owner, self.raw = owner, owner.sock.makefile("rb", buffering=0)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        self.owner.bound()
        return self.raw.readinto(buffer)

    def close(self) -> None:
        self.raw.close()
        super().close()


class _Deadline:
    """A connection (mixed into ``http.client``'s) whose socket is a :class:`_DeadlineSocket`."""

    def __init__(self, *args: Any, deadline: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self) -> None:
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self.deadline)


class _DeadlineHTTPConnection(_Deadline, http.client.HTTPConnection):
    pass


class _DeadlineHTTPSConnection(_Deadline, http.client.HTTPSConnection):
    pass


class _DeadlineHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """urllib's http and https handlers in one (``build_opener`` then adds neither), its connections bounded by
    ``deadline``."""

    def __init__(self, deadline: float):
        super().__init__()
        self.deadline = deadline

    def http_open(self, request: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(lambda host, **kwargs: _DeadlineHTTPConnection(host, deadline=self.deadline, **kwargs),
                            request)

    def https_open(self, request: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(lambda host, **kwargs: _DeadlineHTTPSConnection(host, deadline=self.deadline, **kwargs),
                            request, context=self._context)


def open_before(request: urllib.request.Request, deadline: float) -> http.client.HTTPResponse:
    """``urllib.request.urlopen(request)``, every wait of it (connecting, sending, each read of the reply, also
    after this returns) ending at ``deadline`` with :class:`TimeoutError` (``urllib.error.URLError`` around it while
    connecting or sending); an HTTP error status raises ``urllib.error.HTTPError`` as ``urlopen`` does."""
    opener = urllib.request.build_opener(_DeadlineHandler(deadline))
    return opener.open(request, timeout=max(deadline - time.monotonic(), 0.001))


def read_at_most(reply: BinaryIO, limit: int) -> bytes:
    """The reply's body, or :class:`ReplyTooLarge` when it declares more than ``limit`` bytes (nothing read) or sends
    more (``limit`` + 1 read)."""
    declared = reply.headers.get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ReplyTooLarge(f"a reply of {int(declared)} bytes, over its bound of {limit} bytes")
    body = bytearray()
    while len(body) <= limit:
        chunk = reply.read(min(_CHUNK, limit + 1 - len(body)))
        if not chunk:
            return bytes(body)
        body += chunk
    raise ReplyTooLarge(f"a reply over its bound of {limit} bytes")
