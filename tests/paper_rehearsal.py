"""Dress rehearsals of the paper configs: the YAML as shipped, run through the ``flowkit`` CLI on 2 CPU ranks, a delta
after its base as a user composes it (``--config configs/rlfr_qwen.yaml --config configs/rlfr_qwen_async.yaml``).

Only what a CPU machine cannot hold is overridden: the backbone (a bundled tiny model), the accelerator (cpu),
the devices (2), the step count, the data (bundled), the lengths, for rlfr_qwen_async.yaml the address its
rollout server listens on (a free port of the test's), and for rlfr_qwen_tools.yaml the environment with its data
(the bundled tool-use policy was taught long_addition's ``add`` tool, not ``calculate``: both are multi-turn tool
episodes graded on a boxed answer, and calculator_math is tested on its own, tests/agents/test_agent_envs.py). Everything else — the DeepSpeed strategy and
its ZeRO config, ``bf16-mixed``, micro-batches, gradient checkpointing, the chunked LM head, the flow reward — is the
file's. The lengths are chosen so that ranks disagree the way they do at scale: responses of different lengths,
different numbers of accepted rollouts, and several LM-head and flow-scoring chunks per micro-batch.

A script (not an in-process call) because Lightning relaunches the command once per extra rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from config_layers import config_args

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"

_SHRUNK_RUN = [
    "--trainer.accelerator", "cpu",
    "--trainer.devices", "2",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]

# rlfr_qwen.yaml's and rlfr_qwen_async.yaml's (the same job, generation on a rollout server) shared overrides
_RLFR_QWEN = [
    "--model.init_args.backbone", "bundled:tiny_adder",
    "--model.init_args.sampling.max_new_tokens", "28",
    "--model.init_args.rollout.batch_size", "8",       # 2 generate calls (decoding batches on a server) per rank
    "--model.init_args.update.lm_head_chunk_size", "8",       # ~10 LM-head chunks per micro-batch of 4
    "--model.init_args.reward_model.init_args.network.max_rows_per_call", "48",  # 16 tokens × 3 layers per field call
    "--model.init_args.reward_model.init_args.network.max_rows_per_piece", "96",  # several flow-loss pieces per update
    "--model.init_args.reward_model.init_args.online.kappa", "2",  # the online flow step comes in step 1
    "--data.init_args.train_path", "bundled:arithmetic/train.jsonl",
    "--data.init_args.eval_paths", "{heldout: bundled:arithmetic/val.jsonl}",
    "--data.init_args.max_val_examples", "8",
    "--data.init_args.prompt_key", "prompt",
    "--data.init_args.prompt_template", "{prompt}",
    "--data.init_args.batch_size", "4",                 # 2 prompts × 8 samples per rank
    "--data.init_args.val_batch_size", "4",
]

# What each paper config needs beyond _SHRUNK_RUN: backbone, data and lengths.
OVERRIDES: dict[str, list[str]] = {
    "rlfr_qwen.yaml": [*_RLFR_QWEN, "--model.init_args.rollout.vllm_max_model_len", "128"],
    # the rollout server (its address, a free port, is the test's to add): no vLLM setting of its own
    "rlfr_qwen_async.yaml": _RLFR_QWEN,
    # the official online protocol: micro-batches of 1 row (16 per rank and step), 8 minibatches of 2 rows
    "rlfr_qwen_official.yaml": [
        "--model.init_args.backbone", "bundled:tiny_adder",
        "--model.init_args.sampling.max_new_tokens", "28",
        "--model.init_args.rollout.batch_size", "8",
        "--model.init_args.update.lm_head_chunk_size", "8",
        "--model.init_args.rollout.vllm_max_model_len", "128",
        "--model.init_args.reward_model.init_args.network.max_rows_per_call", "24",  # 8 tokens per call: rows of 1-4 calls
        "--model.init_args.reward_model.init_args.network.max_rows_per_piece", "48",  # several flow-loss pieces per step
        "--data.init_args.train_path", "bundled:arithmetic/train.jsonl",
        "--data.init_args.eval_paths", "{heldout: bundled:arithmetic/val.jsonl}",
        "--data.init_args.max_val_examples", "8",
        "--data.init_args.prompt_key", "prompt",
        "--data.init_args.prompt_template", "{prompt}",
        "--data.init_args.batch_size", "4",
        "--data.init_args.val_batch_size", "4",
    ],
    # episodes of 2-6 policy turns and 150-320 tokens (max_tokens), a rank's 16 of different lengths and turn counts
    "rlfr_qwen_tools.yaml": [
        "--model.init_args.backbone", "bundled:tiny_tool_adder",
        "--model.init_args.episodes.environment", "long_addition",
        "--model.init_args.episodes.max_tokens", "320",
        "--model.init_args.sampling.max_new_tokens", "64",        # per turn
        "--model.init_args.rollout.vllm_max_model_len", "320",
        "--model.init_args.update.lm_head_chunk_size", "64",      # 1-4 LM-head chunks per micro-batch of 4
        "--model.init_args.reward_model.init_args.network.max_rows_per_call", "192",  # 64 tokens × 3 layers per call
        "--model.init_args.reward_model.init_args.network.max_rows_per_piece", "384",  # several flow-loss pieces
        "--model.init_args.reward_model.init_args.online.kappa", "2",
        "--data.init_args.train_path", "bundled:long_addition/k3/train.jsonl",
        "--data.init_args.prompt_key", "prompt",
        "--data.init_args.prompt_template", "{prompt}",
        "--data.init_args.batch_size", "4",                 # 2 prompts × 8 samples per rank
    ],
    "rlfr_qwen_offline.yaml": [
        "--model.init_args.backbone", "bundled:tiny_adder",
        "--model.init_args.reward_model.init_args.network.max_rows_per_piece", "96",  # several pieces per batch and rank
        "--data.init_args.train_path", "bundled:arithmetic/train.jsonl",
        "--data.init_args.prompt_key", "prompt",
        "--data.init_args.prompt_template", "{prompt}",
        "--data.init_args.batch_size", "8",                 # 4 solutions per rank, of different lengths
    ],
    "explain_llama.yaml": [
        "--model.init_args.backbone", "bundled:explain_tiny/policy",
        "--model.init_args.reward_model.init_args.proxies",
        "[bundled:explain_tiny/proxy0, bundled:explain_tiny/proxy1, bundled:explain_tiny/proxy2]",
        "--model.init_args.sampling.max_new_tokens", "16",
        # one LM-head chunk per response token of a micro-batch of 1 row: ranks whose rows differ in length (the
        # rehearsal's explanations run 13-16 tokens) run different numbers of chunks, which they must agree on
        "--model.init_args.update.lm_head_chunk_size", "1",
        "--model.init_args.reward_model.init_args.flow_epochs_per_round", "2",
        "--model.init_args.reward_model.init_args.round_contexts", "8",
        "--model.init_args.reward_model.init_args.heldout_contexts", "8",
        "--trainer.callbacks.rounds", "1",
        "--trainer.callbacks.policy_epochs_per_round", "1",
        "--data.init_args.train_path", "bundled:gridworld/train.jsonl",
        "--data.init_args.test_path", "bundled:gridworld/test.jsonl",
        "--data.init_args.num_test", "8",
        "--data.init_args.batch_size", str(4),              # 2 contexts per rank and step, one micro-batch each
    ],
}
EXPLANATION_BATCH = 4


def env() -> dict[str, str]:
    """tests/ importable (callbacks), DeepSpeed on CPU, one thread per rank (2 ranks share 2 cores)."""
    paths = [str(ROOT / "tests"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1"}


def command(config: str, root: Path, steps: int, *extra: str) -> list[str]:
    """``flowkit fit`` of ``configs/<config>`` for ``steps`` RL (or pretraining) steps, into ``root``; rlfr_qwen.yaml
    and rlfr_qwen_async.yaml validate once at the end, explain_llama.yaml evaluates at its round's start and at the end."""
    flowkit = str(Path(sys.executable).parent / "flowkit")  # this interpreter's (the vLLM venv's under its tests)
    if config == "explain_llama.yaml":  # one round of one pass: as many RL steps as batches of contexts
        length = ["--data.init_args.num_train", str(steps * EXPLANATION_BATCH)]
    else:
        length = ["--trainer.max_steps", str(steps)]
        if config in ("rlfr_qwen.yaml", "rlfr_qwen_async.yaml"):
            length += ["--trainer.val_check_interval", str(steps)]
    return [flowkit, "fit", *config_args(CONFIGS / config), *_SHRUNK_RUN, *OVERRIDES[config], *length,
            "--trainer.default_root_dir", str(root / "run"), *extra]


def run(config: str, root: Path, steps: int, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the rehearsal from the repository root (the configs name ``configs/deepspeed/*.json`` relatively); a
    hang is a failure (``timeout``)."""
    root.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(command(config, root, steps, *extra), env=env(), cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result
