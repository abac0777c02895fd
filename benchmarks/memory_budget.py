"""Per-GPU memory budget of configs/rlfr_qwen.yaml (Qwen2.5-Math-7B on 8 × H200, ZeRO-3, bf16-mixed), computed.

    python benchmarks/memory_budget.py          # prints the memory table of docs/guides/paper-setting.md

Parameter counts come from the model classes built on the meta device (nothing is downloaded or allocated): the
policy from Qwen2.5-Math-7B's config, the flow from ``VelocityField(3584, depth=6)``. Byte counts follow from the
config (ZeRO-3 over 8 ranks, bf16 weights with fp32 master, Adam, gradients accumulated in fp32 —
configs/deepspeed/zero3.json's ``data_types.grad_accum_dtype`` —, micro-batches of 4 sequences of ≤ 4096 tokens,
LM-head chunks of 1024 tokens, vLLM at 35 % of the GPU). Two inputs are measured on CPU, not derived: the activation
bytes a recomputed decoder layer keeps per token (303 KiB at d 3584) and the flow's saved bytes per field row in the
backward (1.13 MiB at depth 6, width 3584, fp32; docs/guides/paper-setting.md, bench_rl_memory.py --mode pieces).
"""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flowkit.rewards.flow import VelocityField

GiB = 2**30
RANKS = 8
GPU_GIB = 140  # an H200's 141 GB as CUDA reports it
MICRO_BATCH, MAX_LEN, SEQUENCES_PER_RANK = 4, 4096, 128  # micro_batch_size; vllm_max_model_len; 16 prompts × 8
LM_HEAD_CHUNK, SCORING_ROWS, PIECE_ROWS = 1024, 8192, 8192  # lm_head_chunk_size, max_rows_per_call / _piece
VLLM_SHARE = 0.35
PERCENTILES = 3
LAYER_RECOMPUTE_BYTES_PER_TOKEN = 303 * 2**10  # measured on CPU (docs/guides/paper-setting.md)
FLOW_SAVED_BYTES_PER_ROW_FP32 = 1.13 * 2**20  # measured on CPU, depth 6, width 3584 (docs/guides/paper-setting.md)
ZERO3_MAX_LIVE_PARAMETERS, ZERO3_BUCKET = 1e9, 5e7  # DeepSpeed's default; zero3.json's bucket sizes

QWEN_MATH_7B = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                           num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)


def parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def budget() -> tuple[list[tuple[str, str, float]], dict[str, float]]:
    """(what, arithmetic, GiB per rank) rows and the per-phase totals."""
    with torch.device("meta"):
        policy = parameters(Qwen2ForCausalLM(QWEN_MATH_7B))
        flow = parameters(VelocityField(QWEN_MATH_7B.hidden_size, depth=6))
    d, vocab, layers = QWEN_MATH_7B.hidden_size, QWEN_MATH_7B.vocab_size, QWEN_MATH_7B.num_hidden_layers
    head_dim = d // QWEN_MATH_7B.num_attention_heads
    trained = policy + flow
    tokens = MICRO_BATCH * MAX_LEN
    kv_per_token = layers * 2 * QWEN_MATH_7B.num_key_value_heads * head_dim * 2
    rows = [
        ("policy + flow shard, bf16", f"2 B × ({policy / 1e9:.3f} + {flow / 1e9:.3f}) B params / {RANKS}",
         2 * trained / RANKS / GiB),
        ("fp32 master", f"4 B × {trained / 1e9:.3f} B / {RANKS}", 4 * trained / RANKS / GiB),
        ("Adam m, v (fp32)", f"8 B × {trained / 1e9:.3f} B / {RANKS}", 8 * trained / RANKS / GiB),
        ("gradient partitions, fp32 (grad_accum_dtype)", f"4 B × {trained / 1e9:.3f} B / {RANKS}",
         4 * trained / RANKS / GiB),
        ("ZeRO-3 working set", f"≤ {ZERO3_MAX_LIVE_PARAMETERS:.0e} live gathered params × 2 B + 2 buckets × "
         f"{ZERO3_BUCKET:.0e} × 2 B", (ZERO3_MAX_LIVE_PARAMETERS + 2 * ZERO3_BUCKET) * 2 / GiB),
        ("activations, micro-batch (checkpointed)", f"{MICRO_BATCH} × {MAX_LEN} tokens × ({layers} layer inputs × "
         f"{d} × 2 B + one layer recomputed, 303 KiB, and its gradient)",
         tokens * (layers * d * 2 + 2 * LAYER_RECOMPUTE_BYTES_PER_TOKEN) / GiB),
        ("LM head, once per micro-batch", f"gathered {vocab} × {d} × 2 B + its fp32 gradient × 4 B + "
         f"{LM_HEAD_CHUNK} × {vocab} × 4 B × 3 (logits, softmax, gradient)",
         (vocab * d * 6 + 3 * LM_HEAD_CHUNK * vocab * 4) / GiB),
        ("latents of the micro-batch", f"{PERCENTILES} × {tokens} × {d} × 2 B", PERCENTILES * tokens * d * 2 / GiB),
        ("online flow loss, one backward piece", f"{PIECE_ROWS} rows × 1.13 MiB / 2 (bf16)",
         PIECE_ROWS * FLOW_SAVED_BYTES_PER_ROW_FP32 / 2 / GiB),
        ("vLLM weights", f"2 B × {policy / 1e9:.3f} B", 2 * policy / GiB),
        ("vLLM KV cache", f"{kv_per_token // 1024} KiB/token × {SEQUENCES_PER_RANK} × {MAX_LEN}",
         kv_per_token * SEQUENCES_PER_RANK * MAX_LEN / GiB),
        ("vLLM share (0.35 of the GPU)", f"{VLLM_SHARE} × {GPU_GIB} GiB", VLLM_SHARE * GPU_GIB),
    ]
    gib = {what: value for what, _, value in rows}
    states = sum(gib[what] for what, _, _ in rows[:5])
    phases = {
        "policy update (vLLM asleep)": states + sum(gib[what] for what, _, _ in rows[5:8]),
        "online flow step (vLLM asleep)": states + gib["online flow loss, one backward piece"],
        "generation (trainer idle)": states + gib["vLLM share (0.35 of the GPU)"],
    }
    return rows, phases


def markdown() -> str:
    rows, phases = budget()
    lines = ["| what | arithmetic | GiB per rank |", "|---|---|---|"]
    lines += [f"| {what} | {arithmetic} | {value:.1f} |" for what, arithmetic, value in rows]
    lines += [f"| **{phase}** | sum of the model states and its own rows | **{value:.1f}** |"
              for phase, value in phases.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
