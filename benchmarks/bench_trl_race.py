"""Step-time race: flowkit's PolicyModule vs TRL's GRPOTrainer as plain GRPO, on the bundled tiny task or mid-size.

    python benchmarks/bench_trl_race.py [--size tiny|mid] [--steps 12] [--warmup 2] [--rounds 2] [--clock wall|process]
                                        [--trl-venv build/trl_venv]

``--size tiny`` (default): the bundled ``tiny_adder`` policy in fp32, 16 prompts per step, 8 samples per prompt, 28
new tokens, the binary verifier (flowkit's grader) as the reward. ``--size mid`` looks like real work: a random Qwen2
of 19 M parameters (hidden 320, 6 layers, GQA 5/1 heads, vocabulary 32k: a character tokenizer padded with filler
tokens) built in a temporary directory, 4 prompts × 8 samples, 256 new tokens, and long-tailed response lengths: the
EOS row of the (tied) output embedding points along the mean final hidden state, so EOS comes at once in some samples,
after a few dozen tokens in others and not before 256 in some. A random policy never answers right, so the reward
is a TRL-style function both sides call, ``scrambled``: a hash of the completion's text scaled to [0, 1), which
differs between samples (every group has a non-zero advantage) but carries nothing to learn, and the learning rate is
1e-7, so the length distribution stays where the EOS bias puts it (at 5e-5 the random policy's lengths ran to 1
token within five steps under a reward for brevity, to 256 within two under this one, leaving nothing to time). A
step's time follows its lengths, and each side samples its own, so the race reports the mean s/step beside the
median, each side's mean response length, and the mean step time per response token.

Both sides: the same prompts per step in the same order (flowkit's prompt stream, written to a JSONL file that TRL
reads unshuffled), temperature 1, top-p 1, lr 5e-5 (mid: 1e-7; constant, AdamW, no weight decay), grad-norm clip 1,
clip ε 0.2, no KL, token-mean loss over the step's completions (TRL ``loss_type="dapo"``, whose normaliser spans the
generation batch), group-normalised advantages, one update per generation, no gradient checkpointing, no vLLM, no
evaluation, no checkpoints. Each side runs in its own process with one thread; ``--rounds`` alternates them back to
back so machine load hits all alike, round r seeding every side with r. Reports the median and mean s/step after
``--warmup`` steps per side (over all rounds) and the ratios flowkit / TRL (issue 46: ≤ 0.70 tiny, ≤ 0.40 mid); the
decoder positions each side ran per step, generating and training (the work behind the times); then the learning:
each side's mean outcome reward over its steps (warm-up included) per round, and flowkit − TRL paired by round (mean ±
standard error) beside TRL's spread over the rounds (meaningful on the tiny task: the mid one has nothing to learn).
Appends one row per side with the library versions. Each side trains in the micro-batches that were fastest for it
(``SIZES``; ``--token-budget`` and ``--trl-micro-batches`` re-check them): flowkit packs rows under
``micro_batch_tokens`` 2048 (on the tiny task the update is ~10% faster than at 1024 and ~5% faster than in one
micro-batch, measured interleaved in one process by ``benchmarks/bench_update_budget.py``) and, at mid size, packs
them padding-free (``update.padding_free``: the update 1.13–1.14× faster on these long-tailed lengths,
docs/results/benchmarks.md) and runs a micro-batch's LM head in one piece, its
logits kept for the backward (``update.lm_head_chunk_size: null``; at most 2048 × 32k floats, 256 MB, where TRL holds
the whole step's); TRL trains the step's rows in one batch (gradient accumulation over 2 or 4 micro-batches,
generating all rows first, gave 0.546 and 0.539 vs 0.535 s/step on the tiny task). Two more flowkit sides show
where the difference comes from: ``flowkit-every-row`` runs ``update.skip_zero_advantage_rows: false`` (TRL forwards
every row too), and ``flowkit-reference`` runs flowkit's kernels off (``FLOWKIT_KERNELS=reference``): PyTorch's and
HF's ops throughout, as TRL runs them — ``F.linear`` instead of the oneDNN route for float32 CPU products
(flowkit.kernels.cpu_linear: about 2× faster on AMD Zen 5, whose full-width AVX-512 MKL's AVX2 kernels leave half
unused; elsewhere for large products only), HF's forward at every decoding step instead of flowkit's
(flowkit.llm.decode_step), PyTorch's RMSNorm, SwiGLU, decoding attention, rotary embedding and LM-head softmax
instead of flowkit's native CPU kernels, and transformers' ``sdpa`` with its copies of the KV heads instead of
flowkit's (flowkit.llm.sdpa).

TRL is never a flowkit dependency: the first run creates its own venv (``torch==2.13.0`` first, so pip takes the
local CPU wheel instead of a multi-GB CUDA build, then ``trl==1.16.0`` and the grader's ``math-verify``), and its
worker imports nothing of flowkit but the grader module, loaded from its file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TINY_ADDER = REPO / "flowkit" / "assets" / "tiny_adder"
SAMPLES = 8
SIZES = {  # prompts per step, new tokens, reward, learning rate; each side's fastest micro-batching (measured)
    "tiny": {"prompts": 16, "new_tokens": 28, "reward": "binary", "lr": 5e-5,
             "token_budget": 2048, "padding_free": False, "lm_head_chunk": 1024, "trl_micro_batches": 1},
    "mid": {"prompts": 4, "new_tokens": 256, "reward": "scrambled", "lr": 1e-7,
            "token_budget": 2048, "padding_free": True, "lm_head_chunk": None, "trl_micro_batches": 1},
}
EOS_LOGIT = 10.0  # the mid policy's EOS logit at its mean final hidden state
SIDES = ("flowkit", "flowkit-every-row", "flowkit-reference", "trl")
FLOWKIT_SIDES = SIDES[:-1]
TRL_PINS = ("torch==2.13.0", "trl==1.16.0", "math-verify==0.9.0")  # math-verify: the grader's fallback


def single_thread_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1"}


def ensure_trl_venv(venv: Path) -> Path:
    """The TRL venv's python, creating the venv on first use."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import trl, math_verify"],
                                          capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    for pin in TRL_PINS:  # torch first: trl's unpinned torch requirement would otherwise pull a CUDA build
        subprocess.run([python, "-m", "pip", "install", "-q", pin], check=True)
    return python


def scrambled(prompts, completions, **_) -> list[float]:
    """The mid-size race's reward (TRL's reward-function signature, also flowkit's): CRC-32 of the completion / 2³²."""
    return [zlib.crc32(completion.encode()) / 2 ** 32 for completion in completions]


def build_mid_policy(directory: Path) -> None:
    """The mid-size random policy and its tokenizer (see the module docstring), saved to ``directory``."""
    import torch
    from tokenizers import processors

    from bench_rl_memory import padded_char_tokenizer
    from flowkit.llm.tiny import tiny_qwen2

    torch.manual_seed(0)
    tokenizer = padded_char_tokenizer(32000)
    # no BOS: TRL tokenizes prompts without special tokens, flowkit with them; without any, both read the same ids
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    model = tiny_qwen2(32000, hidden_size=320, num_layers=6, num_heads=5, num_kv_heads=1, intermediate_size=1280,
                       max_positions=512, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        hidden = model(input_ids=torch.randint(4, 32000, (16, 128)), output_hidden_states=True).hidden_states[-1]
        mean = hidden.reshape(-1, hidden.shape[-1]).mean(0)
        model.get_output_embeddings().weight[tokenizer.eos_token_id] = EOS_LOGIT * mean / mean.dot(mean)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def write_prompt_stream(path: Path, steps: int, prompts: int) -> None:
    """flowkit's training prompts for ``steps`` steps, in order (PolicyModule's datamodule defaults, seed 0)."""
    from flowkit.modules import RolloutDataModule
    from flowkit.modules.datamodule import PromptStream

    data = RolloutDataModule(val_path=None, batch_size=prompts)
    data.setup("fit")
    stream = PromptStream(data.train_records, prompts, data.seed)
    with path.open("w") as f:
        for index in range(steps):
            batch = stream.batch(index)
            for prompt, answer in zip(batch["prompt"], batch["answer"]):
                f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")


# ------------------------------------------------------------------------------------------------- workers
def count_positions(decode_step: type | None = None) -> dict[str, int]:
    """Counts the positions every decoder forward of a Qwen2 runs, into ``{"generation": n, "training": n}`` (no
    grad: sampling; grad: the training passes), so the race shows the work each side does beside its time; with
    ``decode_step`` (flowkit's :class:`~flowkit.llm.decode_step.DecodeStep`), its decoding steps too."""
    import torch
    from transformers.models.qwen2 import modeling_qwen2

    counts = {"generation": 0, "training": 0}
    forward = modeling_qwen2.Qwen2Model.forward

    def counted(self, input_ids=None, *args, **kwargs):
        shape = input_ids.shape if input_ids is not None else kwargs["inputs_embeds"].shape[:2]
        counts["training" if torch.is_grad_enabled() else "generation"] += shape[0] * shape[1]
        return forward(self, input_ids, *args, **kwargs)

    modeling_qwen2.Qwen2Model.forward = counted
    if decode_step is not None:
        step = decode_step.__call__

        def counted_step(self, input_ids, *args, **kwargs):
            counts["generation"] += input_ids.numel()
            return step(self, input_ids, *args, **kwargs)

        decode_step.__call__ = counted_step
    return counts


def flowkit_worker(steps: int, warmup: int, skip_zero_advantage_rows: bool, size: str, policy: Path,
                   token_budget: int, clock: str, seed: int) -> dict:
    import lightning
    import torch
    import transformers

    import flowkit
    from bench_rl_step import time_steps
    from flowkit.llm.decode_step import DecodeStep
    from flowkit.modules.policy_options import OptimOptions, SamplingOptions, UpdateOptions

    torch.set_num_threads(1)
    positions = count_positions(DecodeStep)
    setting = SIZES[size]
    options = {} if size == "tiny" else {
        "backbone": str(policy), "outcome_reward": "none",
        "reward_functions": [{"function": "bench_trl_race.scrambled"}]}
    timer = time_steps(None, steps, warmup, prompts=setting["prompts"], clock=clock, seed=seed,
                       sampling=SamplingOptions(num_samples=SAMPLES, max_new_tokens=setting["new_tokens"]),
                       optim=OptimOptions(lr=setting["lr"], flow_lr=1e-3),
                       update=UpdateOptions(micro_batch_tokens=token_budget or None,
                                            padding_free=setting["padding_free"],
                                            lm_head_chunk_size=setting["lm_head_chunk"],
                                            skip_zero_advantage_rows=skip_zero_advantage_rows), **options)
    return {"times": timer.times, "mean_length": statistics.mean(timer.lengths), "rewards": timer.rewards,
            "positions": {phase: count / (steps + warmup) for phase, count in positions.items()},
            "versions": f"flowkit {flowkit.__version__}, lightning {lightning.__version__}, "
                        f"transformers {transformers.__version__}, torch {torch.__version__}"}


def trl_worker(steps: int, warmup: int, prompts_path: Path, size: str, policy: Path, micro_batches: int,
               clock: str, seed: int) -> dict:
    import importlib.util

    import torch
    import transformers
    import trl
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.set_num_threads(1)
    positions = count_positions()
    spec = importlib.util.spec_from_file_location("flowkit_grader", REPO / "flowkit" / "data" / "grader.py")
    grader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grader)

    def binary_reward(completions, answer, **_):
        return [grader.outcome_reward(c, a, "binary", 1.0) for c, a in zip(completions, answer)]

    from common import CLOCKS

    tick = CLOCKS[clock]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.rewards: list[float] = []

        def on_step_begin(self, *args, **kwargs):
            self._start = tick()

        def on_step_end(self, *args, **kwargs):
            self.times.append(tick() - self._start)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    setting = SIZES[size]
    config = trl.GRPOConfig(
        output_dir=str(prompts_path.parent / "trl_out"), max_steps=steps + warmup, seed=seed,
        # micro_batches > 1: the step's rows generated at once, then trained in that many gradient-accumulation steps
        num_generations=SAMPLES, per_device_train_batch_size=setting["prompts"] * SAMPLES // micro_batches,
        gradient_accumulation_steps=micro_batches,
        num_iterations=1, max_completion_length=setting["new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", use_vllm=False,
        learning_rate=setting["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False, shuffle_dataset=False,
        eval_strategy="no", save_strategy="no", report_to="none", logging_steps=1, log_completions=False,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    source = TINY_ADDER if size == "tiny" else policy
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    timer = StepTimer()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=binary_reward if size == "tiny" else scrambled, args=config,
                              processing_class=tokenizer,
                              train_dataset=load_dataset("json", data_files=str(prompts_path), split="train"),
                              callbacks=[timer])
    trainer.train()
    mean_length = next((float(h["completions/mean_length"]) for h in reversed(trainer.state.log_history)
                        if "completions/mean_length" in h), float("nan"))  # over all steps, warm-up included
    return {"times": timer.times[warmup:], "mean_length": mean_length, "rewards": timer.rewards,
            "positions": {phase: count / (steps + warmup) for phase, count in positions.items()},
            "versions": f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}"}


# ------------------------------------------------------------------------------------------------- driver
def run_worker(python: Path, side: str, args: argparse.Namespace, prompts_path: Path, seed: int) -> dict:
    out = prompts_path.parent / f"{side}.json"
    command = [python, __file__, "--worker", side, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--seed", str(seed),
               "--size", args.size, "--token-budget", str(args.token_budget),
               "--trl-micro-batches", str(args.trl_micro_batches), "--clock", args.clock,
               "--prompts-file", str(prompts_path),
               "--result", str(out)]
    env = single_thread_env()
    if side == "flowkit-reference":  # flowkit's kernels off: PyTorch's and HF's ops, as TRL runs them
        env["FLOWKIT_KERNELS"] = "reference"
    subprocess.run(command, check=True, env=env, cwd=prompts_path.parent)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the four sides, back to back")
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--token-budget", type=int, default=None,
                        help="flowkit's micro_batch_tokens (0: none; default: the size's fastest, SIZES)")
    parser.add_argument("--trl-micro-batches", type=int, default=None,
                        help="TRL's gradient-accumulation steps per step (default: the size's fastest, SIZES)")
    parser.add_argument("--clock", choices=["wall", "process"], default="wall",
                        help="what a step's time is: wall seconds, or the process's CPU seconds (each side runs one "
                             "thread, so on an idle machine the two agree; under other jobs' load only the CPU "
                             "seconds stay comparable)")
    parser.add_argument("--trl-venv", default=str(REPO / "build" / "trl_venv"))
    parser.add_argument("--csv", default=None)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.token_budget = SIZES[args.size]["token_budget"] if args.token_budget is None else args.token_budget
    args.trl_micro_batches = args.trl_micro_batches or SIZES[args.size]["trl_micro_batches"]
    rows = SIZES[args.size]["prompts"] * SAMPLES
    if rows % args.trl_micro_batches:
        parser.error(f"--trl-micro-batches must divide the step's {rows} rows")
    if args.worker:
        sys.path.insert(0, str(HERE))
        policy = Path(args.prompts_file).parent / "mid_policy"
        result = (trl_worker(args.steps, args.warmup, Path(args.prompts_file), args.size, policy,
                             args.trl_micro_batches, args.clock, args.seed)
                  if args.worker == "trl" else
                  flowkit_worker(args.steps, args.warmup, args.worker != "flowkit-every-row", args.size, policy,
                                 args.token_budget, args.clock, args.seed))
        Path(args.result).write_text(json.dumps(result))
        return

    import tempfile

    sys.path.insert(0, str(HERE))
    from common import append_csv, timestamp

    trl_python = ensure_trl_venv(Path(args.trl_venv))
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    versions: dict[str, str] = {}
    lengths: dict[str, list[float]] = {side: [] for side in SIDES}
    rewards: dict[str, list[float]] = {side: [] for side in SIDES}  # per round: the mean outcome reward of its steps
    positions: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}  # per round: per step, by phase
    with tempfile.TemporaryDirectory(prefix="bench_trl_race_") as tmp:
        prompts_path = Path(tmp) / "prompts.jsonl"
        write_prompt_stream(prompts_path, args.steps + args.warmup, SIZES[args.size]["prompts"])
        if args.size == "mid":
            build_mid_policy(Path(tmp) / "mid_policy")
        for round_ in range(args.rounds):
            for side in SIDES:
                python = trl_python if side == "trl" else Path(sys.executable)
                result = run_worker(python, side, args, prompts_path, seed=round_)
                rewards[side].append(statistics.mean(result["rewards"]))
                times[side] += result["times"]
                versions[side] = result["versions"]
                lengths[side].append(result["mean_length"])
                positions[side].append(result["positions"])
    medians = {side: statistics.median(t) for side, t in times.items()}
    means = {side: statistics.mean(t) for side, t in times.items()}  # mid: a step's cost varies with its lengths
    for side, t in times.items():
        ordered = sorted(t)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        print(f"{side:17s} median {medians[side]:.3f} s/step  mean {means[side]:.3f}  p20 {pick(0.2):.3f}  "
              f"p80 {pick(0.8):.3f}  "
              f"mean response {statistics.mean(lengths[side]):.1f} tokens ({len(t)} steps; {versions[side]})")
        append_csv(args.csv, {
            "timestamp": timestamp(), "benchmark": "trl_race", "implementation": side, "device": "cpu",
            "dtype": "float32", "threads": 1,
            "size": f"{'tiny_adder' if args.size == 'tiny' else 'random Qwen2 19M, vocab 32k'} "
                    f"{SIZES[args.size]['prompts']}x{SAMPLES}, {SIZES[args.size]['new_tokens']} new",
            "median_ms": 1e3 * medians[side], "mean_ms": 1e3 * means[side], "p20_ms": 1e3 * pick(0.2),
            "p80_ms": 1e3 * pick(0.8),
            "mean_response_tokens": round(statistics.mean(lengths[side]), 1), "versions": versions[side],
            "mean_outcome_reward": statistics.mean(rewards[side]),
            "micro_batching": (f"{args.trl_micro_batches} gradient-accumulation steps" if side == "trl" else
                               f"micro_batch_tokens {args.token_budget or 'none'}"
                               + (", padding-free" if SIZES[args.size]["padding_free"] else "")
                               + f", lm_head_chunk_size {SIZES[args.size]['lm_head_chunk']}"),
        })
    # the sides sample their own lengths
    per_token = {side: means[side] / statistics.mean(lengths[side]) for side in SIDES}
    target = {"tiny": 0.70, "mid": 0.40}[args.size]
    for side in FLOWKIT_SIDES:
        print(f"{side} / TRL ({args.size}): step time median {medians[side] / medians['trl']:.2f}, mean "
              f"{means[side] / means['trl']:.2f}, mean per response token {per_token[side] / per_token['trl']:.2f} "
              f"(issue 46: <= {target:.2f}; {args.clock} clock)")
    print_positions(positions)
    print_learning(rewards, args.steps + args.warmup)


def print_positions(positions: dict[str, list[dict[str, float]]]) -> None:
    """The decoder positions each side ran per step (all steps, all rounds), generation and training, and flowkit's
    over TRL's: the work behind the step times."""
    work = {side: {phase: statistics.mean(r[phase] for r in rounds) for phase in ("generation", "training")}
            for side, rounds in positions.items()}
    for side, phases in work.items():
        print(f"{side:17s} decoder positions per step: generation {phases['generation']:.0f}, "
              f"training {phases['training']:.0f}")
    for side in FLOWKIT_SIDES:
        ratios = ", ".join(f"{phase} {work[side][phase] / work['trl'][phase]:.2f}" for phase in work[side])
        print(f"{side} / TRL positions: {ratios}")


def print_learning(rewards: dict[str, list[float]], steps: int) -> None:
    """Each side's mean outcome reward over its ``steps`` steps per round (round r runs seed r on every side) and
    flowkit − TRL paired by round, mean ± standard error, beside TRL's spread over the rounds."""
    for side, means in rewards.items():
        print(f"{side:17s} mean outcome reward over {steps} steps, per round: {', '.join(f'{m:.4f}' for m in means)}")
    if len(rewards["trl"]) < 2:
        return
    spread = statistics.stdev(rewards["trl"])
    for side in FLOWKIT_SIDES:
        differences = [a - b for a, b in zip(rewards[side], rewards["trl"])]
        error = statistics.stdev(differences) / len(differences) ** 0.5
        print(f"{side} - TRL: {statistics.mean(differences):+.4f} ± {error:.4f} (paired over {len(differences)} "
              f"rounds; TRL's standard deviation over rounds {spread:.4f})")


if __name__ == "__main__":
    main()
