"""Bytes and time of a weight push to a ``flowkit rollout-server`` for a LoRA policy, ``rollout.server_lora_push:
merged`` against ``adapter``, in one run.

    python benchmarks/bench_lora_push.py [--pushes 5] [--rounds 2] [--r 16]

The policy is the TRL race's mid-size random Qwen2 (benchmarks/bench_trl_race.py ``build_mid_policy``: 19 M
parameters, hidden 320, 6 layers, GQA 5/1 heads, vocabulary 32k, tied embeddings) in fp32 with flowkit's default LoRA
(``--r``, alpha = r, on q/k/v/o and gate/up/down). One HF-backend server on loopback serves it (gloo channel). Per
round and mode a fresh engine pushes ``--pushes`` versions, each after a stand-in for an optimizer step (every
adapter's B moved by Gaussian noise; the base weights are frozen, as under LoRA); the first push over a channel is
the one that carries the base weights in ``adapter`` mode, the later ones carry only A and B. The modes alternate
within each round so that machine load hits both alike. Reported per mode: the payload bytes of the first push and
of each later push (the buckets' bytes, tensors 64-byte aligned; :class:`~flowkit.llm.server_engine.PushReceipt`),
the median wall time of a later push (the trainer's side: HTTP request, send, the server's load and its
acknowledgement), and the ratios merged / adapter. After each mode's last push the server's greedy decode of two
prompts must equal the trainer's (the pushes landed), or the benchmark stops. Rows go to
benchmarks/results/results.csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
PROMPTS = ["12+30=", "7+8="]
MODES = ("merged", "adapter")


def push_round(model, tokenizer, url: str, mode: str, pushes: int) -> dict:
    """One engine of ``mode`` pushing ``pushes`` versions: each push's payload bytes and wall time."""
    from flowkit.llm.hf_engine import HFRolloutEngine
    from flowkit.llm.server_engine import ServerRolloutEngine

    engine = ServerRolloutEngine(model, tokenizer, url, timeout_s=120, max_new_tokens=8, lora_push=mode)
    adapters_b = [p for name, p in model.named_parameters() if ".lora_B." in name]
    payloads, seconds = [], []
    for version in range(pushes):
        with torch.no_grad():
            for weight in adapters_b:  # a stand-in for an optimizer step: the adapters move, the base stays
                weight.add_(torch.randn_like(weight), alpha=1e-3)
        start = time.perf_counter()
        engine.sync_weights(model, version + 1)
        seconds.append(time.perf_counter() - start)
        payloads.append(engine.last_push.payload_bytes)
    served = engine.generate(PROMPTS, n=1, temperature=0).responses
    local = HFRolloutEngine(model, tokenizer, max_new_tokens=8).generate(PROMPTS, n=1, temperature=0).responses
    if served != local:
        raise RuntimeError(f"{mode}: the server decodes {served}, the trainer {local}")
    engine.close()
    return {"payloads": payloads, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pushes", type=int, default=5, help="pushes per engine (the first carries the base)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = r)")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    if args.pushes < 2:
        parser.error("--pushes must be at least 2 (the first push carries the base weights)")
    torch.set_num_threads(1)
    from bench_async import start_server
    from bench_trl_race import build_mid_policy
    from common import append_csv, timestamp
    from flowkit.llm.backbone import load_backbone
    from flowkit.llm.lora import LoraSettings, apply_lora

    with tempfile.TemporaryDirectory() as directory:
        policy_dir = Path(directory) / "policy"
        build_mid_policy(policy_dir)
        server, url = start_server(Path(directory) / "server.log", str(policy_dir), timeout_s=120)
        try:
            model, tokenizer = load_backbone(str(policy_dir))
            model = apply_lora(model, LoraSettings(r=args.r, alpha=args.r))
            runs = {mode: [] for mode in MODES}
            for _ in range(args.rounds):
                for mode in MODES:
                    runs[mode].append(push_round(model, tokenizer, url, mode, args.pushes))
        finally:
            server.kill()
            server.wait(timeout=30)
    parameters = sum(p.numel() for name, p in model.named_parameters() if ".lora_" not in name)
    summary = {}
    for mode, rounds in runs.items():
        later = [payload for run in rounds for payload in run["payloads"][1:]]
        assert len(set(later)) == 1 and len({run["payloads"][0] for run in rounds}) == 1, (mode, rounds)
        summary[mode] = {"first_bytes": rounds[0]["payloads"][0], "later_bytes": later[0],
                         "later_ms": 1e3 * statistics.median(s for run in rounds for s in run["seconds"][1:]),
                         "first_ms": 1e3 * statistics.median(run["seconds"][0] for run in rounds)}
        values = summary[mode]
        print(f"{mode:8s} first push {values['first_bytes'] / 2**20:8.2f} MiB {values['first_ms']:8.0f} ms | later "
              f"push {values['later_bytes'] / 2**20:8.3f} MiB {values['later_ms']:8.0f} ms (median)")
    bytes_ratio = summary["merged"]["later_bytes"] / summary["adapter"]["later_bytes"]
    time_ratio = summary["merged"]["later_ms"] / summary["adapter"]["later_ms"]
    print(f"merged / adapter, later pushes: {bytes_ratio:.1f}x the bytes, {time_ratio:.2f}x the time "
          f"(policy {parameters / 1e6:.1f} M parameters, LoRA r {args.r})")
    common = {"benchmark": "lora_push", "device": "cpu", "dtype": "float32", "size": f"mid19M_r{args.r}",
              "n": args.rounds, "timestamp": timestamp()}
    for mode, values in summary.items():
        for push in ("first", "later"):
            append_csv(args.csv, {**common, "implementation": mode, "kind": f"{push}_push", "metric": "payload_bytes",
                                  "value": values[f"{push}_bytes"], "median_ms": values[f"{push}_ms"]})
    append_csv(args.csv, {**common, "implementation": "merged/adapter", "kind": "later_push",
                          "metric": "payload_bytes_ratio", "value": bytes_ratio})
    append_csv(args.csv, {**common, "implementation": "merged/adapter", "kind": "later_push",
                          "metric": "median_time_ratio", "value": time_ratio})

if __name__ == "__main__":
    main()
