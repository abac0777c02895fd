"""Build the bundled explanation-reward toy task: grid-world data and tiny explanation/proxy LLMs.

Run once from the repository root (a few minutes on 2 CPU cores)::

    python scripts/make_explain_data.py

Writes ``flowkit/assets/gridworld/{train,test}.jsonl`` (records ``{context, decisions, decision,
explanation, kind, implied, preferred}``, see :mod:`flowkit.explain.gridworld`) and, under
``flowkit/assets/explain_tiny/``, a word-level explanation LLM ``policy`` fine-tuned on
``explanation_prompt(context) → explanation`` (a mix of informative, filler and misleading references, so
it starts imperfect) and three proxy LLMs ``proxy0..2`` fine-tuned on ``proxy_prompt(context, s^{1:k}) →
decision`` with the loss on the decision only. A proxy's label is the decision the reasoning implies
(a uniformly random one for filler) with 10 % label noise and its own seed, so the proxies are
independent, noisy judges. Everything is seeded.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

from flowkit.explain.gridworld import DECISIONS, make_records
from flowkit.explain.prompts import explanation_prompt, proxy_prompt
from flowkit.explain.proxy import decision_logits
from flowkit.explain.sentences import split_sentences
from flowkit.explain.tokenizer import word_tokenizer
from flowkit.llm.sft import completion_tensors
from flowkit.llm.tiny import tiny_qwen2

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "flowkit" / "assets" / "gridworld"
MODELS = ROOT / "flowkit" / "assets" / "explain_tiny"
POLICY_SHAPE = dict(hidden_size=96, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=256)
PROXY_SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def sft(model, tensors, steps: int, batch_size: int, lr: float, seed: int, name: str) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    start = time.time()
    for step in range(steps):
        index = torch.randint(0, tensors[0].shape[0], (batch_size,), generator=generator)
        input_ids, mask, labels = (t[index] for t in tensors)
        width = int(mask.sum(-1).max())
        loss = model(input_ids=input_ids[:, :width], attention_mask=mask[:, :width], labels=labels[:, :width]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  {name} step {step:4d} loss {loss.item():.3f} ({time.time() - start:.0f}s)", flush=True)
    model.eval()


def proxy_pairs(records: list[dict], seed: int, noise: float,
                misreading: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(proxy prompt over s^{1:k}, " label") for every record and prefix k ≥ 1.

    ``misreading`` maps an implied decision to the one this proxy reads instead (a systematic error, used by
    ``scripts/make_noisy_proxies.py``); None: every implied decision is read as it is."""
    misreading = misreading or {}
    rng = random.Random(seed)
    pairs = []
    for rec in records:
        sentences = split_sentences(rec["explanation"])
        for k in range(1, len(sentences) + 1):
            implied = misreading.get(rec["implied"], rec["implied"])
            label = implied or rng.choice(DECISIONS)
            if rng.random() < noise:
                label = rng.choice(DECISIONS)
            pairs.append((proxy_prompt(rec["context"], " ".join(sentences[:k])), " " + label))
    return pairs


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=400)
    parser.add_argument("--policy-steps", type=int, default=600)
    parser.add_argument("--proxy-steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the machine is shared; more threads only contend

    train, test = make_records(args.train, args.seed), make_records(args.test, args.seed + 1)
    write_jsonl(DATA / "train.jsonl", train)
    write_jsonl(DATA / "test.jsonl", test)
    tokenizer = word_tokenizer(
        text for r in train + test
        for text in (explanation_prompt(r["context"]), r["explanation"], proxy_prompt(r["context"], ""), *DECISIONS))

    policy = tiny_qwen2(len(tokenizer), **POLICY_SHAPE)
    pairs = [(explanation_prompt(r["context"]), r["explanation"]) for r in train]
    sft(policy, completion_tensors(tokenizer, pairs, append_eos=True), args.policy_steps, 64, 3e-3, args.seed, "policy")
    policy.generation_config = GenerationConfig(max_new_tokens=24, do_sample=True, temperature=1.0,
                                                pad_token_id=tokenizer.pad_token_id,
                                                eos_token_id=tokenizer.eos_token_id,
                                                bos_token_id=tokenizer.bos_token_id)
    policy.save_pretrained(MODELS / "policy")
    tokenizer.save_pretrained(MODELS / "policy")

    for index in range(3):
        seed = args.seed + 100 + index
        torch.manual_seed(seed)
        proxy = tiny_qwen2(len(tokenizer), **PROXY_SHAPE)
        tensors = completion_tensors(tokenizer, proxy_pairs(train, seed, noise=0.1), append_eos=False)
        sft(proxy, tensors, args.proxy_steps, 64, 3e-3, seed, f"proxy{index}")
        proxy.save_pretrained(MODELS / f"proxy{index}")
        tokenizer.save_pretrained(MODELS / f"proxy{index}")
        logits = decision_logits(proxy, tokenizer, [proxy_prompt(r["context"], r["explanation"]) for r in test],
                                 DECISIONS)
        predicted = [DECISIONS[i] for i in logits.argmax(-1).tolist()]
        for kind in ("informative", "filler", "misleading"):
            rows = [i for i, r in enumerate(test) if r["kind"] == kind]
            agree = sum(predicted[i] == test[i]["decision"] for i in rows) / len(rows)
            print(f"  proxy{index} test accuracy vs true decision on {kind} references: {agree:.2f}")


if __name__ == "__main__":
    main()
