"""Memory of the RL step: peak resident memory of one step as the rollouts per step grow (``--mode step``), and the
activations one flow-loss piece holds for its backward as solutions grow (``--mode pieces``).

    python benchmarks/bench_rl_memory.py [--scales 1,4,16] [--prompts 2] [--samples 4] [--micro-batch-size 8]
    python benchmarks/bench_rl_memory.py --mode pieces [--lengths 256,1024] [--max-rows 4096] [--width 896]

``--mode pieces`` builds a :class:`~flowkit.rewards.FlowReward` (3 percentiles, ``--depth``, ``--width``) and, for
each solution length, counts the bytes of the tensors autograd saves for the backward of one piece
(``torch.autograd.graph.saved_tensors_hooks``, each storage once) — of the online flow update (eq. 4 over accepted
rollouts at the rewarding timestep) and of an offline pretraining batch (2 copies per token) — with pieces of at most
``--max-rows`` field rows, and with one piece (no row bound) for contrast. With a row budget the largest piece must
not grow with the length (issue 24's target: flat); bytes per row scale with the field's width and depth, which
docs/guides/paper-setting.md extrapolates to the 7B field.

The step mode:

Builds a random Qwen2 (vocab 32k, hidden 256, 4 layers; a character tokenizer padded to the vocabulary) in a
temporary directory, then runs ``flowkit fit --trainer.max_steps 1`` (RLFR tiny config, flow reward on, no flow
pretraining, no validation, no checkpoints) once per scale, each in its own process, and reads that process's peak
RSS (``os.wait4``'s ``ru_maxrss``), with glibc's mmap threshold fixed at 64 KiB (``--default-malloc`` keeps its
default) so that freed tensors leave the resident set and the peak counts live memory. Scale s draws
``s × prompts`` prompts × ``samples`` samples. The vocabulary is what makes full logits expensive: B × S × 32k floats
per forward. Issue 10's target: the largest scale's peak ≤ 1.3× the 1× peak. Where PolicyModule has no
``update.micro_batch_size`` yet, the runs go without it (the "before"). Appends one row per scale to
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
from types import SimpleNamespace

import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from flowkit.rewards.flow import flow_matching_loss_pieces
from flowkit.llm.tiny import SPECIAL_TOKENS, tiny_qwen2
from flowkit.modules import PolicyModule
from flowkit.rewards import FlowReward
from flowkit.rewards.flow import LatentOptions, NetworkOptions, ScoringOptions, PretrainingOptions

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
    init["backbone"] = str(backbone)
    init["sampling"].update(num_samples=args.samples, max_new_tokens=args.max_new_tokens)
    init["flow_pretrain"]["steps"] = 0
    if micro_batched:
        init.setdefault("update", {})["micro_batch_size"] = args.micro_batch_size
        init.setdefault("rollout", {})["batch_size"] = args.micro_batch_size
    config["data"]["init_args"].update(batch_size=prompts, val_path=None)
    return config


def peak_rss_mb(config: dict, workdir: Path, default_malloc: bool) -> tuple[float, float]:
    """(peak RSS in MiB, wall seconds) of ``flowkit fit`` on ``config`` in a fresh process."""
    path = workdir / f"step_{config['data']['init_args']['batch_size']}.yaml"
    path.write_text(yaml.safe_dump(config))
    # MALLOC_MMAP_THRESHOLD_: as benchmarks/common.py's memory readings do in-process, tensors are mmap'd and unmapped
    # on free, so the high-water mark counts live memory, not blocks glibc keeps after its threshold grew (it would hide
    # the scaling).
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


def saved_bytes(fn, params: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``fn()`` runs: what a loss piece holds
    until its backward. Parameters (storages in ``params``) are resident anyway and are not counted."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(storages.values())


def piece_memory(args: argparse.Namespace) -> None:
    """``--mode pieces``: the largest piece's saved bytes, online and offline, per solution length and row budget."""
    torch.manual_seed(0)
    percentiles = (0.25, 0.5, 0.75)
    stub = SimpleNamespace(config=SimpleNamespace(hidden_size=args.width, rms_norm_eps=1e-6))
    for max_rows in (args.max_rows, None):
        reward = FlowReward(latents=LatentOptions(percentiles=percentiles, condition="previous"),
                            network=NetworkOptions(depth=args.depth, width=args.width, max_rows_per_piece=max_rows),
                            scoring=ScoringOptions(timesteps=(0.8,)),
                            pretraining=PretrainingOptions(pretrain_timesteps=2), seed=0)
        reward.bind(stub, percentiles)
        params = {p.untyped_storage().data_ptr() for p in reward.parameters()}
        budget = "one piece" if max_rows is None else f"{max_rows} rows"
        for length in [int(v) for v in args.lengths.split(",")]:
            latents = torch.randn(len(percentiles), args.rollouts, length, args.width)
            mask = torch.ones(args.rollouts, length)
            cases = {  # online: every token × layer at the rewarding timestep; offline: 2 copies per token × layer
                "online": (flow_matching_loss_pieces(reward.field, latents, mask, percentiles, torch.tensor([0.8]),
                                                     seed=1, condition="previous", max_rows=max_rows), 1),
                "offline": (reward.pretrain_losses(latents, mask, torch.Generator().manual_seed(0)), 2),
            }
            for name, (pieces, copies) in cases.items():
                largest = max(saved_bytes(piece, params) for piece in pieces)
                rows = min(len(percentiles) * args.rollouts * length * copies, max_rows or 2**62)
                print(f"{name:8s} length {length:5d}: {len(pieces):4d} pieces of {budget:>10s}, the largest saves "
                      f"{largest / 2**20:8.1f} MiB for its backward ({largest / rows / 1024:.1f} KiB per field row)")
                append_csv(args.csv, {
                    "timestamp": timestamp(), "benchmark": "rl_memory_pieces", "implementation": name,
                    "device": "cpu", "dtype": "float32", "threads": torch.get_num_threads(),
                    "size": f"field d{args.width} depth{args.depth}, {args.rollouts} x {length} tokens, P 3",
                    "mode": budget, "pieces": len(pieces), "piece_saved_mib": round(largest / 2**20, 2),
                    "saved_kib_per_row": round(largest / rows / 1024, 2),
                })


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
    parser.add_argument("--mode", choices=["step", "pieces"], default="step")
    parser.add_argument("--lengths", default="256,1024", help="pieces: solution lengths in tokens")
    parser.add_argument("--rollouts", type=int, default=4, help="pieces: accepted rollouts / solutions")
    parser.add_argument("--max-rows", type=int, default=4096, help="pieces: max_rows_per_piece")
    parser.add_argument("--width", type=int, default=896, help="pieces: the backbone's (and field's) width")
    parser.add_argument("--depth", type=int, default=2, help="pieces: the field's depth")
    args = parser.parse_args()
    if args.mode == "pieces":
        piece_memory(args)
        return
    # the option groups of update.micro_batch_size and rollout.batch_size (step_config sets both)
    micro_batched = {"update", "rollout"} <= set(inspect.signature(PolicyModule.__init__).parameters)
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
