"""Scale rehearsal of the RL step: a random-weight Qwen2.5-1.5B-shaped policy, RLFR flow reward, HF rollouts.

    python benchmarks/bench_rl_scale.py                       # one H200: bf16-mixed, 2 steps of 64 prompts x 8 x 1024
    python benchmarks/bench_rl_scale.py --shape toy --device cpu --precision 32-true --prompts 2 --samples 4 \
        --new-tokens 16 --micro-batch-size 4 --rollout-batch-size 8     # the same code path on CPU, in seconds

The policy is built from a config (Qwen2.5-1.5B: 28 layers, hidden 1536, 12 heads / 2 KV heads, intermediate 8960,
vocab 151936, tied embeddings; nothing is downloaded) with a character tokenizer padded to the vocabulary, saved to
a temporary directory and loaded by PolicyModule like any local model, in fp32: one device has no DeepSpeed to keep
an fp32 master copy of bf16 weights (PolicyModule refuses them there), so ``bf16-mixed`` is fp32 weights, gradients
and AdamW state with bf16 compute. Random weights almost never sample EOS, so
every rollout runs the full ``--new-tokens``: the worst case for memory. Prints, per step, the step time and
PolicyModule's own phase timings (``time/*``: generate, score when there is a scoring pass, update, flow) plus the
flow token-reward share of the update (timed here by wrapping ``FlowReward.token_rewards``), the number of online
flow-loss pieces, and the peak memory (CUDA: allocator peak and reserved; CPU: peak RSS). Random weights are never
correct, so the flow trains online on the rollouts of above-median entropy (``--rejection-metric entropy``): half of
each step's rollouts, the online flow step at its largest. Appends one row per step to the CSV.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from flowkit.llm.tiny import tiny_qwen2
from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.modules.policy_options import OptimOptions, RolloutOptions, SamplingOptions, UpdateOptions
from flowkit.rewards import FlowReward
from flowkit.rewards.flow import LatentOptions, NetworkOptions, OnlineOptions, ScoringOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rl_memory import padded_char_tokenizer  # noqa: E402
from common import append_csv, timestamp  # noqa: E402

SHAPES = {  # Qwen2.5-1.5B's config.json; "toy" runs the same path on CPU
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                         intermediate_size=8960, max_positions=32768),
    "toy": dict(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
                max_positions=512),
}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class StepPhases(L.Callback):
    """Per step: wall time (synchronised), PolicyModule's logged ``time/*`` phases, the flow token-reward time and
    the number of online flow-loss pieces (0: no flow step this step)."""

    def __init__(self, device: str):
        self.device, self.steps, self.flow_reward_s, self.flow_pieces = device, [], 0.0, 0

    def wrap_reward(self, reward: FlowReward) -> None:
        begin_step = reward.begin_step

        def wrapped(step, batch):  # each step's scorer: its score timed, its online-loss pieces counted
            scorer = begin_step(step, batch)
            original, original_update = scorer.score, scorer.end_step

            def timed(*args, **kwargs):
                synchronize(self.device)
                start = time.perf_counter()
                out = original(*args, **kwargs)
                synchronize(self.device)
                self.flow_reward_s += time.perf_counter() - start
                return out

            def counted(*args, **kwargs):
                pieces = original_update(*args, **kwargs)
                self.flow_pieces += len(pieces)
                return pieces

            scorer.score, scorer.end_step = timed, counted
            return scorer

        reward.begin_step = wrapped

    def on_train_batch_start(self, *args):
        synchronize(self.device)
        self.flow_reward_s, self.flow_pieces, self._start = 0.0, 0, time.perf_counter()

    def on_train_batch_end(self, trainer, *args):
        synchronize(self.device)
        phases = {key.removeprefix("time/").removesuffix("_s"): float(value)
                  for key, value in trainer.callback_metrics.items() if key.startswith("time/")}
        step = {"step_s": time.perf_counter() - self._start, **phases, "flow_token_rewards": self.flow_reward_s}
        self.steps.append({**step, "flow_pieces": self.flow_pieces})
        # printed as it happens, so a run that dies later (e.g. out of memory) still shows its finished steps
        peak = "  ".join(f"{name.removesuffix('_mb')} {mb / 1024:.2f} GiB" for name, mb in peak_memory_mb(self.device).items())
        print(f"step {len(self.steps) - 1}: " + "  ".join(f"{name} {seconds:.2f} s" for name, seconds in step.items())
              + f"  (online flow loss in {self.flow_pieces} pieces)  peak so far: {peak}", flush=True)


def peak_memory_mb(device: str) -> dict[str, float]:
    if device == "cuda":
        return {"peak_allocated_mb": torch.cuda.max_memory_allocated() / 2 ** 20,
                "peak_reserved_mb": torch.cuda.max_memory_reserved() / 2 ** 20}
    with open("/proc/self/status") as status:
        return {"peak_rss_mb": int(re.search(r"VmHWM:\s+(\d+)", status.read()).group(1)) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "32-true"],
                        help="Lightning precision over fp32 weights (bf16-mixed: bf16 autocast compute)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=8,
                        help="sequences per forward/backward (8 x 1032 tokens: ≈ 30 GiB of activations, no checkpointing)")
    parser.add_argument("--rollout-batch-size", type=int, default=512, help="sequences per generate call")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--rejection-metric", default="entropy", choices=["correct", "entropy", "both"],
                        help="which rollouts train the flow online; random weights are never correct, so the default "
                             "`entropy` (above the batch median) is what makes the online flow step run")
    parser.add_argument("--kappa", type=int, default=32, help="accepted rollouts that trigger a flow step")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU (use --shape toy --device cpu for a CPU smoke run)")
    L.seed_everything(0)
    with tempfile.TemporaryDirectory(prefix="bench_rl_scale_") as tmp:
        tokenizer = padded_char_tokenizer(SHAPES[args.shape]["vocab_size"])
        with torch.device(args.device):  # random init on the GPU: seconds instead of minutes for 1.5 B parameters
            model = tiny_qwen2(**SHAPES[args.shape], pad_token_id=tokenizer.pad_token_id,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        model.config.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}  # Qwen2.5's θ
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        parameters = sum(p.numel() for p in model.parameters())
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
        reward = FlowReward(latents=LatentOptions(percentiles=(0.25, 0.5, 0.75)), network=NetworkOptions(depth=4),
                            scoring=ScoringOptions(timesteps=(0.8,)), seed=0,
                            online=OnlineOptions(kappa=args.kappa, rejection_metric=args.rejection_metric))
        module = PolicyModule(backbone=tmp, dtype="float32", reward_model=reward, outcome_reward="official",
                              gradient_checkpointing=args.gradient_checkpointing,
                              sampling=SamplingOptions(num_samples=args.samples, max_new_tokens=args.new_tokens),
                              update=UpdateOptions(micro_batch_size=args.micro_batch_size),
                              optim=OptimOptions(lr=1e-6, flow_lr=1e-4),
                              rollout=RolloutOptions(batch_size=args.rollout_batch_size))
        data = RolloutDataModule(val_path=None, batch_size=args.prompts)
        phases = StepPhases(args.device)
        phases.wrap_reward(reward)
        trainer = L.Trainer(accelerator="gpu" if args.device == "cuda" else "cpu", devices=1,
                            precision=args.precision, max_steps=args.steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, callbacks=[phases])
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.fit(module, datamodule=data)
    memory = peak_memory_mb(args.device)
    rollouts = args.prompts * args.samples
    size = (f"{args.shape} ({parameters / 1e6:.1f} M params), {rollouts} rollouts x {args.new_tokens} new, "
            f"micro {args.micro_batch_size}, rollout batch {args.rollout_batch_size}"
            + (", grad ckpt" if args.gradient_checkpointing else ""))
    print(f"scale rehearsal: {size}, {args.device} {args.precision}")
    for index, step in enumerate(phases.steps):
        pieces = step.pop("flow_pieces")
        append_csv(args.csv, {"timestamp": timestamp(), "benchmark": "rl_scale", "implementation": f"step {index}",
                              "device": args.device, "dtype": args.precision, "size": size,
                              "threads": torch.get_num_threads(), "step_ms": round(1e3 * step["step_s"], 1),
                              "phases_s": " ".join(f"{k}={v:.3f}" for k, v in step.items()), "flow_pieces": pieces,
                              **{k: round(v, 1) for k, v in memory.items()}})
    print("(update includes the flow token rewards, computed per micro-batch right after its forward)")
    print("peak memory: " + "  ".join(f"{name.removesuffix('_mb')} {mb / 1024:.2f} GiB" for name, mb in memory.items()))


if __name__ == "__main__":
    main()
