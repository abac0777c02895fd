"""Build the bundled tiny policy ``flowkit/assets/tiny_adder`` and the task data ``flowkit/assets/arithmetic``.

Run once from the repository root (a few minutes on 2 CPU cores)::

    python scripts/make_tiny_adder.py

Steps: write the arithmetic splits; build the character tokenizer (with a post-processor
that prepends ``<bos>``) and a randomly initialised tiny Qwen2; supervised fine-tuning on
``<bos> prompt solution <eos>`` with the loss on the response only (AdamW, lr 1e-3, batch 128);
stop at the first evaluation whose greedy validation accuracy lies in the target band, so that RL
starts from a policy that is right about half the time; measure greedy accuracy on val and test and
pass@8 at temperature 1 on test; save model, generation config, tokenizer and a model card.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from flowkit.data.arithmetic import ALPHABET, write_splits
from flowkit.data.grader import extract_boxed
from flowkit.llm.sft import completion_tensors
from flowkit.llm.tiny import char_tokenizer, tiny_qwen2

ROOT = Path(__file__).resolve().parent.parent
MAX_NEW_TOKENS = 32  # the longest response, 99+99, is 27 tokens including <eos>


def build_tokenizer() -> PreTrainedTokenizerBase:
    # <bos> is added by the tokenizer itself, so `tokenizer(prompt)` is the policy's prompt everywhere.
    return char_tokenizer(ALPHABET, add_bos=True)


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f]


@torch.no_grad()
def correct_fraction(model: PreTrainedModel, tokenizer, examples: list[dict], samples: int = 1,
                     seed: int = 0, batch: int = 500) -> tuple[float, float]:
    """(mean accuracy over all samples, pass@samples); greedy when ``samples == 1``, else temperature 1."""
    model.eval()
    hits = []
    for lo in range(0, len(examples), batch):
        chunk = examples[lo:lo + batch]
        enc = tokenizer([ex["prompt"] for ex in chunk], return_tensors="pt", padding=True)
        sampling = dict(do_sample=True, temperature=1.0, top_k=None, top_p=None) if samples > 1 else dict(do_sample=False)
        torch.manual_seed(seed + lo)
        out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=samples, **sampling)
        texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        hits += [[extract_boxed(texts[i * samples + s]) == ex["answer"] for s in range(samples)]
                 for i, ex in enumerate(chunk)]
    model.train()
    per_prompt = torch.tensor(hits, dtype=torch.float)
    return per_prompt.mean().item(), per_prompt.amax(dim=1).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-out", type=Path, default=ROOT / "flowkit/assets/tiny_adder")
    parser.add_argument("--data-out", type=Path, default=ROOT / "flowkit/assets/arithmetic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--band", type=float, nargs=2, default=(0.40, 0.70),
                        help="stop at the first evaluation with greedy val accuracy in [low, high]")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    # One thread: the ~1 M-parameter model gains nothing from more, and on a shared machine extra
    # threads spin-wait (5x slower measured); it also fixes the reduction order across machines.
    torch.set_num_threads(1)
    paths = write_splits(args.data_out, seed=args.seed)
    splits = {name: read_jsonl(path) for name, path in paths.items()}
    tokenizer = build_tokenizer()
    model = tiny_qwen2(len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    input_ids, attention, labels = completion_tensors(tokenizer, [(ex["prompt"], ex["solution"]) for ex in splits["train"]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    order = torch.Generator().manual_seed(args.seed)
    perm, cursor = torch.randperm(len(input_ids), generator=order), 0

    started, step, val_acc = time.time(), 0, 0.0
    low, high = args.band
    model.train()
    while step < args.max_steps:
        if cursor + args.batch_size > len(perm):
            perm, cursor = torch.randperm(len(input_ids), generator=order), 0
        idx = perm[cursor:cursor + args.batch_size]
        cursor += args.batch_size
        loss = model(input_ids=input_ids[idx], attention_mask=attention[idx], labels=labels[idx]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if step % args.eval_every == 0:
            val_acc, _ = correct_fraction(model, tokenizer, splits["val"])
            print(f"step {step:4d}  loss {loss.item():.4f}  val greedy acc {val_acc:.3f}  ({time.time() - started:.0f} s)",
                  flush=True)
            if low <= val_acc <= high:
                break
            if val_acc > high:
                raise SystemExit(f"val accuracy jumped past the band to {val_acc:.3f}; use a smaller --eval-every")
    else:
        raise SystemExit(f"no evaluation within {args.max_steps} steps reached the band {args.band}")

    test_greedy, _ = correct_fraction(model, tokenizer, splits["test"])
    test_sample_mean, test_pass8 = correct_fraction(model, tokenizer, splits["test"], samples=8, seed=args.seed, batch=125)
    print(f"SFT stopped at step {step}; val greedy {val_acc:.3f}; test greedy {test_greedy:.3f}; "
          f"test temperature-1 mean {test_sample_mean:.3f}; test pass@8 {test_pass8:.3f}")

    model.save_pretrained(args.model_out, safe_serialization=True)
    tokenizer.save_pretrained(args.model_out)
    n_params = sum(p.numel() for p in model.parameters())
    (args.model_out / "README.md").write_text(MODEL_CARD.format(
        n_params=n_params, steps=step, batch=args.batch_size, lr=args.lr, seed=args.seed, val=val_acc,
        test=test_greedy, sample_mean=test_sample_mean, pass8=test_pass8, low=low, high=high,
        eval_every=args.eval_every, n_train=len(splits["train"]),
    ))


MODEL_CARD = """\
# tiny_adder

A {n_params:,}-parameter Qwen2-architecture causal LM (hidden 128, 4 layers, 4 heads, 2 KV heads,
intermediate 512, tied embeddings) with a character-level tokenizer, fine-tuned to add two-digit
numbers digit by digit. It is flowkit's bundled policy for the tiny RLFR run: good enough that RL
has signal, far from perfect so that RL has something to improve.

Made by `python scripts/make_tiny_adder.py` (seed {seed}), which also writes the task data in
`flowkit/assets/arithmetic/` (`flowkit.data.arithmetic`, {n_train} train / 500 val / 500 test pairs).

## Format

Sequence: `<bos>` + prompt + solution + `<eos>`, e.g. `<bos>47+38=7+8=15,4+3+1=8\\boxed{{85}}<eos>`.
The tokenizer prepends `<bos>` itself (post-processor), so `tokenizer(prompt)` is the full prompt;
generate after it and grade the last `\\boxed{{}}` against the answer. Padding is on the left.
Token ids: `<pad>` 0, `<bos>` 1, `<eos>` 2, `<unk>` 3.

## Training

Supervised fine-tuning from random initialisation, loss on the response tokens only, AdamW lr {lr},
batch {batch}, {steps} steps; greedy validation accuracy was checked every {eval_every} steps and
training stopped at the first check inside [{low:.2f}, {high:.2f}].

## Measured accuracy (exact match of the boxed answer)

| split | metric | value |
|---|---|---|
| val (used for stopping) | greedy | {val:.3f} |
| test | greedy | {test:.3f} |
| test | temperature 1, mean over 8 samples | {sample_mean:.3f} |
| test | pass@8, temperature 1 | {pass8:.3f} |
"""


if __name__ == "__main__":
    main()
