"""Peak resident memory of one RL step as the rollouts per step grow, at a fixed micro-batch.

    python benchmarks/bench_rl_memory.py [--scales 1,4,16] [--prompts 2] [--samples 4] [--micro-batch-size 8]

Builds a random Qwen2 (vocab 32k, hidden 256, 4 layers; a character tokenizer padded to the vocabulary) in a
temporary directory, then runs ``flowkit fit --trainer.max_steps 1`` (RLFR tiny config, flow reward on, no flow
pretraining, no validation, no checkpoints) once per scale, each in its own process, and reads that process's peak
RSS (``os.wait4``'s ``ru_maxrss``), with glibc's mmap threshold fixed at 64 KiB (``--default-malloc`` keeps its
default) so that freed tensors leave the resident set and the peak counts live memory. Scale s draws
``s × prompts`` prompts × ``samples`` samples. The vocabulary is what makes full logits expensive: B × S × 32k floats
per forward. Issue 10's target: the largest scale's peak ≤ 1.3× the 1× peak. Where PolicyModule has no
``micro_batch_size`` yet, the runs go without it (the "before"). Appends one row per scale to
benchmarks/results/results.csv.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from flowkit.llm.tiny import SPECIAL_TOKENS, tiny_qwen2
from flowkit.modules import PolicyModule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_csv, timestamp  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ALPHABET = "0123456789+=,\\{}boxed"
MMAP_THRESHOLD = 1 << 16


def padded_char_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """One token per character of the arithmetic alphabet, then filler tokens up to ``vocab_size``, so every id a
    random policy samples decodes (fillers are never produced by encoding: the pre-tokenizer splits characters)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(set(ALPHABET)):
        vocab.setdefault(char, len(vocab))
    for i in range(vocab_size - len(vocab)):
        vocab[f"<filler{i}>"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False, padding_side="left")


def save_random_policy(directory: Path, vocab_size: int, hidden: int, layers: int) -> None:
    torch.manual_seed(0)
    tokenizer = padded_char_tokenizer(vocab_size)
    model = tiny_qwen2(vocab_size, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
                       intermediate_size=4 * hidden, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def step_config(backbone: Path, prompts: int, args: argparse.Namespace, micro_batched: bool) -> dict:
    """configs/rlfr_tiny.yaml with the random backbone, one step, and nothing that is not the RL step."""
    config = yaml.safe_load((REPO / "configs" / "rlfr_tiny.yaml").read_text())
    config["trainer"].update(max_steps=1, logger=False, callbacks=[], enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    config["trainer"].pop("val_check_interval", None)
    init = config["model"]["init_args"]
    init.update(backbone=str(backbone), num_samples=args.samples, max_new_tokens=args.max_new_tokens,
                flow_pretrain_steps=0)
    if micro_batched:
        init.update(micro_batch_size=args.micro_batch_size, rollout_batch_size=args.micro_batch_size)
    config["data"]["init_args"].update(batch_size=prompts, val_path=None)
    return config


def peak_rss_mb(config: dict, workdir: Path, default_malloc: bool) -> tuple[float, float]:
    """(peak RSS in MiB, wall seconds) of ``flowkit fit`` on ``config`` in a fresh process."""
    path = workdir / f"step_{config['data']['init_args']['batch_size']}.yaml"
    path.write_text(yaml.safe_dump(config))
    # MALLOC_MMAP_THRESHOLD_: as benchmarks/common.py does in-process, tensors are mmap'd and unmapped on free, so the
    # high-water mark counts live memory, not blocks glibc keeps after its threshold grew (it would hide the scaling).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "flowkit", "fit", "--config", str(path)], cwd=workdir, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"flowkit fit failed (exit {process.returncode}) on {path}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default="1,4,16", help="multiples of the 1x rollouts per step")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step at 1x")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8,
                        help="sequences per forward/backward and per generate call (a multiple of --samples)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's growing mmap threshold on (the RSS peak then also counts freed blocks it keeps)")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    micro_batched = {"micro_batch_size", "rollout_batch_size"} <= set(inspect.signature(PolicyModule.__init__).parameters)
    scales = [int(s) for s in args.scales.split(",")]
    peaks = {}
    with tempfile.TemporaryDirectory(prefix="bench_rl_memory_") as tmp:
        workdir = Path(tmp)
        save_random_policy(workdir / "policy", args.vocab, args.hidden, args.layers)
        for scale in scales:
            prompts = scale * args.prompts
            peak, seconds = peak_rss_mb(step_config(workdir / "policy", prompts, args, micro_batched), workdir,
                                        args.default_malloc)
            peaks[scale] = peak
            rollouts = prompts * args.samples
            mode = f"micro_batch_size={args.micro_batch_size}" if micro_batched else "whole batch (no micro_batch_size)"
            print(f"{scale:3d}x  {rollouts:5d} rollouts  peak RSS {peak:8.1f} MiB  ({seconds:.0f} s)  {mode}")
            append_csv(args.csv, {
                "timestamp": timestamp(), "benchmark": "rl_memory", "implementation": "flowkit fit max_steps 1",
                "device": "cpu", "dtype": "float32", "threads": 1, "mode": mode,
                "size": f"qwen2 V{args.vocab} d{args.hidden} L{args.layers}, {rollouts} rollouts x {args.max_new_tokens} new",
                "malloc": "glibc default" if args.default_malloc else f"mmap threshold {MMAP_THRESHOLD // 1024} KiB",
                "scale": scale, "peak_rss_mb": round(peak, 1), "peak_ratio_to_smallest": round(peak / peaks[scales[0]], 3),
            })
    print(json.dumps({f"{s}x/{scales[0]}x": round(peaks[s] / peaks[scales[0]], 3) for s in scales}))


if __name__ == "__main__":
    main()
