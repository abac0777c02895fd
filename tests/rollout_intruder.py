"""A second process against a ``flowkit rollout-server`` (tests/llm/test_rollout_server_security.py): a neighbour on
the node, with or without the server's secret, that tries to drive it. Prints one JSON line: what each request got.

    python rollout_intruder.py URL ACTION [--token TOKEN] [--run RUN] [--port PORT]

ACTION ``push``: host a weight-channel store of its own, ``POST /weights/connect`` to it, ``POST /weights
{"version": 999999}``, and, if both were accepted, push every weight of the model zeroed; ``connect``: the connect
alone (to its own store, or to ``--port`` if given); ``weights``: ``POST /weights {"version": 1}`` alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

import torch


def request(url: str, path: str, body: dict | None, headers: dict[str, str]) -> dict:
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data=data, headers=headers,
                                                           method="GET" if body is None else "POST"),
                                    timeout=60) as response:
            return {"status": response.status, **json.loads(response.read())}
    except urllib.error.HTTPError as err:
        return {"status": err.code, **json.loads(err.read())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("action", choices=("push", "connect", "weights"))
    parser.add_argument("--token")
    parser.add_argument("--run", default="intruder")
    parser.add_argument("--port", type=int)
    options = parser.parse_args()
    headers = {"Flowkit-Run": options.run}
    if options.token:
        headers["Authorization"] = f"Bearer {options.token}"
    from flowkit.llm.server_engine import WeightChannel, weight_buckets

    results: dict[str, dict] = {}
    store = None
    if options.action in ("push", "connect"):
        port = options.port
        if port is None:
            store = WeightChannel.host_store("127.0.0.1", 30)
            port = store.port
        results["connect"] = request(options.url, "/weights/connect", {"port": port, "device": "cpu"}, headers)
    if options.action in ("push", "weights"):
        version = 999999 if options.action == "push" else 1
        results["weights"] = request(options.url, "/weights", {"version": version}, headers)
    if options.action == "push" and results["connect"]["status"] == results["weights"]["status"] == 200:
        from flowkit.llm.backbone import load_backbone

        model, _ = load_backbone("bundled:tiny_adder")
        channel = WeightChannel(store, 0, 30, torch.device("cpu"))
        zeroed = ((name, torch.zeros_like(p)) for name, p in model.named_parameters(remove_duplicate=False))
        for bucket, last in weight_buckets(zeroed, 1 << 20):
            channel.send_bucket(bucket, 999999, last)
        results["acknowledged"] = {"loaded": channel.acknowledgement(999999)}
    print(json.dumps(results))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
