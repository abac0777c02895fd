"""Build the sparse-outcome task: data ``flowkit/assets/long_addition`` and policy ``flowkit/assets/long_adder``.

Run from the repository root (deterministic, one thread)::

    python scripts/make_long_adder.py              # build data, policy and model card
    python scripts/make_long_adder.py --measure    # re-measure the bundled policy (the model card's table)

Steps: write the splits of every difficulty ``k`` (operands; :mod:`flowkit.data.long_addition`); build the
adder's character tokenizer and a randomly initialised tiny Qwen2 of the adder's shape; supervised fine-tuning on
``<bos> prompt solution <eos>`` over the train splits of all ``k`` mixed (loss on the response only, AdamW,
batch 128); every ``--eval-every`` steps, once greedy decoding solves any validation prompt of the default
difficulty, sample the policy at temperature 1 on them with flowkit's rollout engine (the sampler RL uses) and stop
at the first check whose per-sample accuracy lies in ``--band``: a policy that is right now and then, so that most
groups of 8 samples are all wrong but RL still sees some correct samples. Then measure greedy accuracy, pass@1 and
pass@8 at temperature 1 on the test split of every ``k`` and write model, tokenizer, generation config and model card.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from flowkit.data.grader import grade
from flowkit.data.long_addition import ALPHABET, DEFAULT_OPERANDS, OPERAND_COUNTS, max_new_tokens, write_splits
from flowkit.llm.backbone import load_backbone
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.sft import completion_tensors
from flowkit.llm.tiny import char_tokenizer, tiny_qwen2

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "flowkit/assets/long_adder"
DATA_DIR = ROOT / "flowkit/assets/long_addition"


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f]


@torch.no_grad()
def sample_hits(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, records: list[dict], samples: int,
                temperature: float, seed: int, new_tokens: int, rollout_batch_size: int = 512) -> torch.Tensor:
    """Correctness (prompts × samples, bool) of ``samples`` responses per prompt from flowkit's rollout engine
    (temperature 0: greedy), after ``torch.manual_seed(seed)``."""
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=new_tokens, temperature=temperature,
                           rollout_batch_size=max(samples, rollout_batch_size // samples * samples))
    torch.manual_seed(seed)
    batch = engine.generate([r["prompt"] for r in records], samples, [r["answer"] for r in records])
    hits = [grade(response, answer) for response, answer in zip(batch.responses, batch.answers)]
    return torch.tensor(hits).view(len(records), samples)


def pass_at_k(hits: torch.Tensor, k: int) -> float:
    """Mean over prompts of the unbiased pass@k estimate 1 − C(n−c, k) / C(n, k) from n samples with c correct
    (Chen et al. 2021); ``k = n`` is the fraction of prompts with a correct sample."""
    n = hits.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 ≤ k ≤ {n} samples per prompt")
    correct = hits.sum(1).tolist()
    return sum(1.0 - math.comb(n - c, k) / math.comb(n, k) for c in correct) / len(correct)


def measure(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, split: str, prompts: int, samples: int,
            seed: int) -> list[dict]:
    """Per difficulty: greedy accuracy, pass@1 and pass@``samples`` at temperature 1, and the fraction of prompts
    whose ``samples`` samples are all wrong (= 1 − pass@samples: a GRPO group of that size without signal)."""
    rows = []
    for k in OPERAND_COUNTS:
        records = read_jsonl(DATA_DIR / f"k{k}" / f"{split}.jsonl")[:prompts]
        greedy = sample_hits(model, tokenizer, records, 1, 0.0, seed, max_new_tokens(k))
        sampled = sample_hits(model, tokenizer, records, samples, 1.0, seed, max_new_tokens(k))
        rows.append({"operands": k, "prompts": len(records), "greedy": greedy.float().mean().item(),
                     "pass@1": pass_at_k(sampled, 1), f"pass@{samples}": pass_at_k(sampled, samples),
                     "all_wrong": 1.0 - pass_at_k(sampled, samples)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def finetune(args, tokenizer: PreTrainedTokenizerBase) -> tuple[PreTrainedModel, int, float]:
    """SFT until the first check inside the band → (model, steps, validation pass@1 at that check)."""
    paths = write_splits(DATA_DIR, seed=args.seed)
    train = [ex for k in OPERAND_COUNTS for ex in read_jsonl(paths[k]["train"])]
    val = read_jsonl(paths[DEFAULT_OPERANDS]["val"])[:args.eval_prompts]
    model = tiny_qwen2(len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    input_ids, attention, labels = completion_tensors(tokenizer, [(ex["prompt"], ex["solution"]) for ex in train])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    order = torch.Generator().manual_seed(args.seed)
    perm, cursor = torch.randperm(len(input_ids), generator=order), 0
    started, low, high = time.time(), *args.band
    model.train()
    for step in range(1, args.max_steps + 1):
        if cursor + args.batch_size > len(perm):
            perm, cursor = torch.randperm(len(input_ids), generator=order), 0
        idx = perm[cursor:cursor + args.batch_size]
        cursor += args.batch_size
        loss = model(input_ids=input_ids[idx], attention_mask=attention[idx], labels=labels[idx]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % args.eval_every:
            continue
        # the sampled check (8x the cost) only once greedy decoding solves some validation prompt
        greedy = sample_hits(model, tokenizer, val, 1, 0.0, args.seed, max_new_tokens(DEFAULT_OPERANDS))
        model.train()
        if not greedy.any():
            print(f"step {step:5d}  loss {loss.item():.4f}  val k={DEFAULT_OPERANDS} greedy 0  "
                  f"({time.time() - started:.0f} s)", flush=True)
            continue
        hits = sample_hits(model, tokenizer, val, args.eval_samples, 1.0, args.seed, max_new_tokens(DEFAULT_OPERANDS))
        accuracy = pass_at_k(hits, 1)
        model.train()
        print(f"step {step:5d}  loss {loss.item():.4f}  val k={DEFAULT_OPERANDS} greedy {greedy.float().mean():.3f}  "
              f"pass@1 (T=1) {accuracy:.3f}  "
              f"pass@{args.eval_samples} {pass_at_k(hits, args.eval_samples):.3f}  ({time.time() - started:.0f} s)",
              flush=True)
        if low <= accuracy <= high:
            return model, step, accuracy
        if accuracy > high:
            raise SystemExit(f"validation pass@1 jumped past the band to {accuracy:.3f}; use a smaller --eval-every "
                             "or --lr")
    raise SystemExit(f"no check within {args.max_steps} steps reached the band {args.band}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="only re-measure the bundled policy (no building)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=4000)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-prompts", type=int, default=100, help="validation prompts per check")
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per prompt per check")
    parser.add_argument("--band", type=float, nargs=2, default=(0.03, 0.08),
                        help=f"stop at the first check whose validation pass@1 (T=1, k={DEFAULT_OPERANDS}) is in "
                             "[low, high]")
    parser.add_argument("--test-prompts", type=int, default=500)
    parser.add_argument("--test-samples", type=int, default=8)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    # One thread: the ~1 M-parameter model gains nothing from more, and it fixes the reduction order.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.measure:
        model, tokenizer = load_backbone(str(MODEL_DIR))
        measure(model.eval(), tokenizer, "test", args.test_prompts, args.test_samples, args.seed)
        return
    tokenizer = char_tokenizer(ALPHABET, add_bos=True)  # the adder's tokenizer: <bos> added by the tokenizer
    model, steps, val_accuracy = finetune(args, tokenizer)
    rows = measure(model.eval(), tokenizer, "test", args.test_prompts, args.test_samples, args.seed)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=max_new_tokens(max(OPERAND_COUNTS)))
    model.save_pretrained(MODEL_DIR, safe_serialization=True)
    tokenizer.save_pretrained(MODEL_DIR)
    table = "\n".join(f"| {r['operands']} | {r['greedy']:.3f} | {r['pass@1']:.3f} | "
                      f"{r[f'pass@{args.test_samples}']:.3f} | {r['all_wrong']:.3f} |" for r in rows)
    (MODEL_DIR / "README.md").write_text(MODEL_CARD.format(
        n_params=sum(p.numel() for p in model.parameters()), seed=args.seed, steps=steps, lr=args.lr,
        batch=args.batch_size, eval_every=args.eval_every, eval_prompts=args.eval_prompts,
        eval_samples=args.eval_samples, low=args.band[0], high=args.band[1], val=val_accuracy, k=DEFAULT_OPERANDS,
        n=args.test_samples, prompts=args.test_prompts, table=table, counts="/".join(map(str, OPERAND_COUNTS)),
        new_tokens=" / ".join(f"{max_new_tokens(k)} (k={k})" for k in OPERAND_COUNTS)))


MODEL_CARD = """\
# long_adder

A {n_params:,}-parameter Qwen2-architecture causal LM (the shape of `tiny_adder`: hidden 128, 4 layers, 4 heads,
2 KV heads, intermediate 512, tied embeddings; the same character tokenizer), fine-tuned only briefly to add
{counts} three-digit numbers column by column. It is flowkit's bundled policy for the sparse-outcome task (issue 25):
at the default difficulty (k = {k} operands) it is right in a few samples at temperature 1, so most GRPO groups of 8
samples are all wrong and carry no outcome signal.

Made by `python scripts/make_long_adder.py` (seed {seed}), which also writes the task data in
`flowkit/assets/long_addition/k{{2,3,4}}/{{train,val,test}}.jsonl` (`flowkit.data.long_addition`; 4000 / 500 / 500
per k).

## Format

Sequence: `<bos>` + prompt + solution + `<eos>`, e.g.
`<bos>347+281+905=7+1+5=13,4+8+0+1=13,3+2+9+1=15\\boxed{{1533}}<eos>`. The tokenizer prepends `<bos>` itself,
so `tokenizer(prompt)` is the full prompt; generate after it and grade the last `\\boxed{{}}`. Padding is on the
left. Token ids: `<pad>` 0, `<bos>` 1, `<eos>` 2, `<unk>` 3. Generation budget: {new_tokens} new tokens.

## Training

Supervised fine-tuning from random initialisation on the train splits of all k mixed, loss on the response tokens
only, AdamW lr {lr}, batch {batch}, {steps} steps. Every {eval_every} steps, once greedy decoding solved any of
{eval_prompts} validation prompts of k = {k}, the policy was sampled at temperature 1 on them ({eval_samples} samples
each, flowkit's rollout engine); training stopped at the first check with pass@1 inside [{low:.2f}, {high:.2f}]
(it stopped at {val:.3f}).

## Measured accuracy (test split, exact match of the boxed answer)

{prompts} prompts per k; pass@1 and pass@{n} from {n} samples per prompt at temperature 1 (unbiased estimator);
"all wrong" is the fraction of prompts whose {n} samples are all wrong (1 − pass@{n}). Measured by
`python scripts/make_long_adder.py --measure` (seed {seed}; one thread).

| operands k | greedy | pass@1 (T=1) | pass@{n} (T=1) | all {n} wrong |
|---|---|---|---|---|
{table}
"""


if __name__ == "__main__":
    main()
