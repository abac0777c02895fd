"""An OpenAI-compatible chat server on 127.0.0.1 that answers flowkit's RBRL prompts as a chat model would, with
misbehaving replies mixed in, and with whole-server HTTP faults for the backend's hostile-input tests."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler

from test_chat_backends import ScriptedServer

# The rules this "model" writes: a fixed pool, so a test can cache their embeddings (no encoder needed).
RULE_POOL = [
    {"background": f"Background {i}: {why}", "rule": f"Rule {i}: {what}", "state_relevance": f"Relevance {i}: it applies now."}
    for i, (why, what) in enumerate([
        ("filling bags wastes least", "prefer the fullest bag that fits"),
        ("new bags waste space", "open a new bag only when nothing fits"),
        ("large items are hard to place", "put large items into new bags"),
        ("small items fill gaps", "put small items into the emptiest bag"),
        ("risk grows exponentially", "help whoever is furthest beyond a threshold"),
        ("budget is limited", "keep the resource when nobody is at risk"),
        ("fatigue lowers effects", "avoid acting twice in a row"),
        ("unexpected events matter most", "act when today is far above the recent average"),
        ("late actions help less", "act early when the budget allows"),
        ("stability predicts the future", "leave stable cases alone"),
        ("the first option is simplest", "always take the first valid action"),
        ("variety helps learning", "take the last valid action"),
    ])
]
EMBEDDING_TEXTS = [f"{r['rule']} {r['background']}" for r in RULE_POOL]  # Rule.embedding_text of each

REFUSAL = "I'm sorry, but I can't help with that."
FAULTS = ("non_json", "non_utf8", "short_body", "retry_after_negative", "retry_after_nan", "null_content",
          "huge_declared", "huge_chunked", "drip")


def valid_actions(prompt: str) -> list[int]:
    block = prompt.split("Valid actions:", 1)[1]
    return [int(m) for m in re.findall(r"^(\d+): ", block, flags=re.MULTILINE)]


class ChatModelServer(ScriptedServer):
    """Answers ``POST /v1/chat/completions``. Each reply is drawn from a seeded generator:

    - thoughts: a few lines of text; explanations: a sentence;
    - rules: a JSON list of the requested number of rules from :data:`RULE_POOL` (sometimes in a ```json fence);
      a share ``malformed`` of them is broken (cut-off JSON, a missing field) and a share ``refusing`` a refusal —
      half in words, half as an OpenAI-style ``content: null`` with a ``refusal``;
    - actions: ``{"action": n}`` with n one of the prompt's valid actions, sometimes prose or an invalid number;
    - judge questions: "Yes." / "no" (the paper's questions) or ``{"q1": 1, "q2": 0}`` (the official ones),
      sometimes a refusal in words.

    ``fault`` makes every reply (``fault_on="all"``) or only the judge's (``"judge"``) one of :data:`FAULTS`.
    ``requests`` records each request body.
    """

    def __init__(self, seed: int = 0, malformed: float = 0.15, refusing: float = 0.1, fault: str | None = None,
                 fault_on: str = "all", drip_interval_s: float = 0.5):
        assert fault is None or fault in FAULTS
        self.requests: list[dict] = []
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.malformed, self.refusing = malformed, refusing
        self.fault, self.fault_on, self.drip_interval_s = fault, fault_on, drip_interval_s
        self.kinds: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"]
                with server.lock:
                    server.requests.append(body)
                    kind = server.kind(prompt)
                    server.kinds.append(kind)
                    faulty = server.fault is not None and (server.fault_on == "all" or kind == "judge")
                    message = None if faulty else server.answer(kind, prompt)
                try:
                    if faulty:
                        server.misbehave(self)
                    else:
                        self.send(200, json.dumps({"choices": [{"message": message, "finish_reason": "stop"}]}).encode())
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on this reply

            def send(self, status: int, data: bytes, headers: dict | None = None):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for key, value in {"Content-Length": str(len(data)), **(headers or {})}.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self._serve(Handler)

    @staticmethod
    def kind(prompt: str) -> str:
        if "Answer yes or no." in prompt or "### Rule evaluation" in prompt:
            return "judge"
        if prompt.rstrip().endswith("what you expect to happen next."):
            return "thoughts"
        if "### Rule generation" in prompt:
            return "rules"
        if "### Explanation" in prompt:
            return "explanation"
        return "action"

    def answer(self, kind: str, prompt: str) -> dict:
        """One chat message, as a model would write it (``rng`` under the lock)."""
        roll = self.rng.random()
        text: str | None
        if kind == "thoughts":
            text = "- The state is as described.\n- Acting now changes what comes next.\n- Keep options for later."
        elif kind == "explanation":
            text = "I followed the selected rule: the state matches its condition, so this action was taken."
        elif kind == "judge" and "### Rule evaluation" in prompt:  # the official judge: two answers as JSON
            pair = {"q1": self.rng.choice([0, 1]), "q2": self.rng.choice([0, 1])}
            text = REFUSAL if roll < self.refusing else self.rng.choice([json.dumps(pair), f"```json\n{json.dumps(pair)}\n```"])
        elif kind == "judge":
            text = REFUSAL if roll < self.refusing else self.rng.choice(["Yes.", "yes", "No", "Yes, it is."])
        elif kind == "rules":
            n = int(re.search(r"Write (\d+) different candidate rules", prompt).group(1))
            rules = self.rng.sample(RULE_POOL, min(n, len(RULE_POOL)))
            text = json.dumps(rules, indent=1)
            if roll < self.refusing / 2:
                return {"role": "assistant", "content": None, "refusal": REFUSAL}
            if roll < self.refusing:
                text = REFUSAL
            elif roll < self.refusing + self.malformed / 2:
                text = text[: len(text) // 2]  # cut off mid-JSON, as at max_tokens
            elif roll < self.refusing + self.malformed:
                text = json.dumps([{k: v for k, v in r.items() if k != "state_relevance"} for r in rules])
            elif roll < 0.5:
                text = f"Here are the rules:\n```json\n{text}\n```"
        else:  # an action
            choices = valid_actions(prompt)
            if roll < self.malformed / 2:
                text = "I would choose the best option here."
            elif roll < self.malformed:
                text = json.dumps({"action": max(choices) + 7})  # not a valid action
            else:
                text = json.dumps({"action": self.rng.choice(choices)})
        return {"role": "assistant", "content": text}

    def misbehave(self, handler: BaseHTTPRequestHandler) -> None:
        fault = self.fault
        if fault == "non_json":
            handler.send(200, b"<html><body>502 Bad Gateway</body></html>")
        elif fault == "non_utf8":
            handler.send(200, b'\xff\xfe{"choices": [\x80\x81]}')
        elif fault == "short_body":
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Yes."}}]}).encode()
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(data) + 500))
            handler.end_headers()
            handler.wfile.write(data)
            handler.close_connection = True
        elif fault in ("retry_after_negative", "retry_after_nan"):
            value = "-5" if fault == "retry_after_negative" else "nan"
            handler.send(429 if value == "-5" else 503, b'{"error": "busy"}', {"Retry-After": value})
        elif fault == "null_content":
            handler.send(200, json.dumps({"choices": [{"message": {"role": "assistant", "content": None,
                                                                   "refusal": REFUSAL}}]}).encode())
        elif fault == "huge_declared":
            handler.send_response(200)
            handler.send_header("Content-Length", str(256 * 1024 * 1024))
            handler.end_headers()
            handler.wfile.write(b'{"choices": [' + b" " * 65536)
            handler.close_connection = True
        elif fault == "huge_chunked":
            handler.send_response(200)
            handler.send_header("Transfer-Encoding", "chunked")
            handler.end_headers()
            chunk = b" " * (1024 * 1024)
            for _ in range(256):  # 256 MiB unless the client hangs up first
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            handler.wfile.write(b"0\r\n\r\n")
        elif fault == "drip":
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Yes."}}]}).encode()
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            for byte in data:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                time.sleep(self.drip_interval_s)
