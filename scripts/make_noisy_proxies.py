"""Build the noisy-proxy toy: three tiny proxy LLMs for the bundled grid-world task that are noisy and disagree.

    python scripts/make_noisy_proxies.py            # train, save flowkit/assets/explain_noisy/proxy0..2, measure
    python scripts/make_noisy_proxies.py --measure  # only measure the bundled ones (the model card's tables)

TPL's premise (seed 000 §1, §4, App. D) is that proxy LLMs judge explanations noisily and the rectified flow
fitted to several of them denoises their rewards. ``explain_tiny``'s proxies do not have that property: all
three read the decision an explanation implies with 10 % label noise, which leaves their argmax almost exact.
These proxies are trained as ``explain_tiny``'s (``scripts/make_explain_data.py``: same shape, tokenizer,
training records, prefixes, steps and learning rate) with two kinds of error:

- a systematic one, a different slice per proxy (:data:`MISREADINGS`): proxy k reads one implied decision as
  another (proxy0 north → south, proxy1 east → west, proxy2 south → east), so each proxy rejects the correct
  explanations of one decision and accepts misleading ones that imply its misread decision; every decision is
  misread by at most one proxy, so the majority of the three is right where a single proxy is not;
- heavier random noise: 30 % of the labels are uniformly random (``explain_tiny``: 10 %). Uniform noise
  flattens a proxy's probabilities more than it moves its argmax.

The tokenizer is ``explain_tiny``'s (the policy's and the flow backbone's), so the proxies can replace
``explain_tiny``'s in a config. Everything is seeded; the measurements are printed as the model card's tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
from pathlib import Path

import torch
from make_explain_data import DATA, MODELS, PROXY_SHAPE, proxy_pairs, sft
from transformers import PreTrainedTokenizerFast

from flowkit.explain.gridworld import DECISIONS
from flowkit.explain.proxy import proxy_probabilities
from flowkit.llm.backbone import load_backbone
from flowkit.llm.sft import completion_tensors
from flowkit.llm.tiny import tiny_qwen2

NOISY = MODELS.parent / "explain_noisy"
MISREADINGS = ({"north": "south"}, {"east": "west"}, {"south": "east"})
LABEL_NOISE = 0.3
# The held-out judge of explanation accuracy: explain_tiny's proxy 2, which reads the implied decision
# without systematic error; both toys are then judged by the same model.
CLEAN_EVALUATOR = "bundled:explain_tiny/proxy2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f]


def build(train: list[dict], steps: int, seed: int) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(MODELS / "policy")
    for index, misreading in enumerate(MISREADINGS):
        proxy_seed = seed + 200 + index
        torch.manual_seed(proxy_seed)
        proxy = tiny_qwen2(len(tokenizer), **PROXY_SHAPE)
        pairs = proxy_pairs(train, proxy_seed, noise=LABEL_NOISE, misreading=misreading)
        sft(proxy, completion_tensors(tokenizer, pairs, append_eos=False), steps, 64, 3e-3, proxy_seed,
            f"noisy proxy{index}")
        proxy.save_pretrained(NOISY / f"proxy{index}")
        for name in TOKENIZER_FILES:  # copied, not re-saved: a re-save adds the loader's own options
            shutil.copyfile(MODELS / "policy" / name, NOISY / f"proxy{index}" / name)


def accuracy(predicted: torch.Tensor, target: torch.Tensor, rows: torch.Tensor | None = None) -> str:
    right = predicted == target
    return f"{(right if rows is None else right[rows]).float().mean():.3f}"


def measure(test: list[dict]) -> str:
    """The model card's tables: argmax of each judge on the test split's explanations vs the true decision."""
    names = [f"explain_noisy/proxy{i}" for i in range(len(MISREADINGS))]
    judges = [load_backbone(f"bundled:{name}") for name in names] + [load_backbone(CLEAN_EVALUATOR)]
    contexts = [r["context"] for r in test]
    candidates = [r["decisions"] for r in test]
    target = torch.tensor([r["decisions"].index(r["decision"]) for r in test])
    kinds = [r["kind"] for r in test]
    with torch.no_grad():
        preferred = proxy_probabilities(judges, contexts, [r["preferred"] for r in test], candidates)
        reference = proxy_probabilities(judges, contexts, [r["explanation"] for r in test], candidates)
    noisy, clean = preferred[:-1], preferred[-1]
    votes = noisy.argmax(-1)  # [K, B]
    counts = torch.nn.functional.one_hot(votes, len(DECISIONS)).sum(0)  # [B, |A|]
    has_majority = counts.max(-1).values * 2 > len(names)
    majority = torch.where(has_majority, counts.argmax(-1), -1)
    any_right = (votes == target).any(0)

    lines = [f"Test split: {len(test)} records; preferred explanations (informative, every record) and reference "
             f"explanations ({', '.join(f'{k} {kinds.count(k)}' for k in ('informative', 'filler', 'misleading'))}).",
             "", "| judge | preferred | reference informative | reference filler | reference misleading |",
             "|---|---|---|---|---|"]
    reference_votes = reference.argmax(-1)
    by_kind = {k: torch.tensor([kind == k for kind in kinds]) for k in ("informative", "filler", "misleading")}
    for name, judge_votes, judge_reference in zip(names + [f"{CLEAN_EVALUATOR.removeprefix('bundled:')} (clean)"],
                                                  preferred.argmax(-1), reference_votes, strict=True):
        lines.append(f"| {name} | {accuracy(judge_votes, target)} | "
                     + " | ".join(accuracy(judge_reference, target, rows) for rows in by_kind.values()) + " |")
    lines += [f"| mean of the noisy proxies' probabilities | {accuracy(noisy.mean(0).argmax(-1), target)} | | | |",
              f"| majority of the noisy proxies (≥ 2 of 3; none: wrong) | {accuracy(majority, target)} | | | |",
              f"| union: at least one noisy proxy right | {any_right.float().mean():.3f} | | | |",
              "", "Accuracy on the preferred explanations by true decision:", "",
              "| judge | " + " | ".join(f"{d} ({int((target == i).sum())})" for i, d in enumerate(DECISIONS)) + " |",
              "|---|" + "---|" * len(DECISIONS)]
    for name, judge_votes in zip(names + ["clean evaluator"], preferred.argmax(-1), strict=True):
        lines.append(f"| {name} | " + " | ".join(accuracy(judge_votes, target, target == i)
                                                  for i in range(len(DECISIONS))) + " |")
    lines += ["", "Pairwise agreement (same argmax) on the preferred explanations:", "",
              "| pair | agreement |", "|---|---|"]
    for (i, a), (j, b) in itertools.combinations(enumerate(votes), 2):
        lines.append(f"| proxy{i}, proxy{j} | {(a == b).float().mean():.3f} |")
    lines.append(f"\nMean probability of the true decision on the preferred explanations: "
                 + ", ".join(f"proxy{i} {p.gather(-1, target[:, None]).mean():.3f}" for i, p in enumerate(noisy))
                 + f", clean evaluator {clean.gather(-1, target[:, None]).mean():.3f}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="only measure the bundled noisy proxies")
    parser.add_argument("--proxy-steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the machine is shared; more threads only contend
    if not args.measure:
        build(read_jsonl(DATA / "train.jsonl"), args.proxy_steps, args.seed)
    print(measure(read_jsonl(DATA / "test.jsonl")))


if __name__ == "__main__":
    main()
