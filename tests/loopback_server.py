"""A scripted OpenAI-compatible chat server on 127.0.0.1 for the chat backends' tests and their users'
(``tests/rbrl``, ``tests/explain``): tests import it by module name, as ``tests/`` is on ``sys.path``."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LoopbackHTTP:
    """An HTTP server on 127.0.0.1 (a port the OS picks) serving ``handler`` in daemon threads while the context is
    open; subclasses build their handler and call :meth:`_serve`."""

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class ScriptedServer(LoopbackHTTP):
    """Answers POST /v1/chat/completions with a scripted sequence of (status, body, delay_s)."""

    def __init__(self, script):
        self.script = list(script)
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                status, payload, delay = server.script.pop(0) if len(server.script) > 1 else server.script[0]
                time.sleep(delay)
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and hung up

            def log_message(self, *args):
                pass

        self._serve(Handler)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


def reply(text: str) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": text}}]}
