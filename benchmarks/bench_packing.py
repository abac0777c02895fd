"""The update phase padded vs padding-free (``update.padding_free``) on the mid-size race model, long-tailed lengths.

    python benchmarks/bench_packing.py [--prompts 4] [--new-tokens 256] [--token-budget 2048] [--rounds 5]
                                       [--lm-head-chunk 1024]

The policy is ``bench_trl_race.py``'s mid-size one (a random Qwen2 of 19 M parameters whose EOS bias makes response
lengths long-tailed: EOS at once in some samples, after a few dozen tokens in others, not before ``--new-tokens`` in
some). Its ``--prompts`` × 8 rollouts of the race's first prompts are sampled once; the experience is made once per
side (no reward model, outcome reward ``bench_trl_race.scrambled``; with a scoring pass where the step runs one,
on-policy GRPO runs none); then each round times one update (:meth:`~flowkit.step.PolicyUpdate.train_on`: forward,
loss and backward of every micro-batch, one optimizer step at lr 0, so every round sees the same weights) per side,
the sides alternating, on one thread. Both sides pack micro-batches under ``micro_batch_tokens`` = ``--token-budget``:
padded, rows × longest row; padding-free, real tokens (``--token-budget 0``: one micro-batch of all rows, the B × S
block against one packed sequence); both run the LM head in ``--lm-head-chunk`` token pieces (0: a micro-batch's
logits at once, kept for the backward, as the mid race runs it: one of the head's four matmuls saved). The padded
side runs each group's prompt once where sound (``forward_hidden_shared_prompts``); with ``--tapped`` the policy
carries a latent tap, as under RLFR's flow reward, and no forward shares prompts. Reports each side's median update
and scoring-pass time, its ``perf/padding_frac``, the ratio padded / padding-free (acceptance: ≥ 1.5) beside the most
that removing the padding can give on this model (the ratio of the two sides' matmul and attention work,
:func:`matmul_gflop`, the LM head's included: a machine whose products run at its peak gets near it), and appends
one row to the results CSV.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trl_race import SAMPLES, build_mid_policy, scrambled  # noqa: E402
from common import append_csv, timestamp  # noqa: E402

from flowkit.batch import RolloutBatch  # noqa: E402
from flowkit.llm.backbone import load_backbone  # noqa: E402
from flowkit.llm.hf_engine import HFRolloutEngine  # noqa: E402
from flowkit.llm.latent_tap import LatentTap  # noqa: E402
from flowkit.rl.logprobs import DEFAULT_LM_HEAD_CHUNK  # noqa: E402
from flowkit.step import (  # noqa: E402
    Actor, AdvantageOptions, ExperienceMaker, LossOptions, PolicyUpdate, PromptBatch, SamplingControls,
    TorchOptimizer, UpdateOptions,
)
from flowkit.step.micro_batches import micro_batch_rows, padded_tokens, sequence_lengths  # noqa: E402

SIDES = {"padded": False, "padding_free": True}


class SampledRows:
    """A rollout engine that returns the rows sampled once up front (both sides train on the same rows)."""

    saw_nonfinite_logits, policy_version = False, 0

    def __init__(self, batch: RolloutBatch, tokenizer):
        self.batch, self.tokenizer = batch, tokenizer

    def generate(self, prompts, n=1, answers=None, temperature=None) -> RolloutBatch:
        return self.batch.select(list(range(self.batch.batch_size)))


def grade(batch: RolloutBatch) -> dict:
    batch.outcome_rewards = torch.tensor(scrambled(batch.prompts, batch.responses))
    batch.correct = batch.outcome_rewards > 0.5
    return {}


def matmul_gflop(model, attention_mask: Tensor, response_mask: Tensor, budget: int, padding_free: bool,
                 head_chunked: bool) -> float:
    """The update's matmul and attention GFLOP under the token budget, counted from the micro-batches' shapes: 6 per
    decoder weight and position (forward, two backward products) over rows × longest row or the real tokens; 8 per
    LM-head weight and response token on both sides (the chunked head's forward, the backward's recomputation and
    its two products; 6 unchunked, its logits kept); 12 per layer, width and (query, key) pair of each attention,
    whole squares (the SDPA kernels here do not skip the causal half) over each padded micro-batch or each packed
    row."""
    config = model.config
    head = config.vocab_size * config.hidden_size
    decoder = sum(p.numel() for name, p in model.named_parameters() if "layers." in name)
    attention = 12 * config.num_hidden_layers * config.hidden_size
    if padding_free:
        lengths = attention_mask.sum(-1)
        positions, pairs = int(lengths.sum()), int((lengths ** 2).sum())
    else:
        lengths = sequence_lengths(attention_mask)
        runs = micro_batch_rows(attention_mask, None, budget)
        positions = padded_tokens(lengths, runs)
        pairs = sum(len(run) * int(lengths[run].max()) ** 2 for run in runs)
    head_products = 8 if head_chunked else 6
    return (6 * decoder * positions + head_products * head * float(response_mask.sum()) + attention * pairs) / 1e9


def first_prompts(count: int) -> list[str]:
    """The race's first step's prompts (PolicyModule's datamodule defaults, seed 0)."""
    from flowkit.modules import RolloutDataModule
    from flowkit.modules.datamodule import PromptStream

    data = RolloutDataModule(val_path=None, batch_size=count)
    data.setup("fit")
    return PromptStream(data.train_records, count, data.seed).batch(0)["prompt"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--token-budget", type=int, default=2048,
                        help="micro_batch_tokens of both sides (0: none, all rows in one micro-batch)")
    parser.add_argument("--rounds", type=int, default=5, help="timed updates per side, alternating, after one warm-up")
    parser.add_argument("--lm-head-chunk", type=int, default=DEFAULT_LM_HEAD_CHUNK,
                        help="update.lm_head_chunk_size of both sides (0: null, a micro-batch's logits kept for the "
                             "backward, as the mid race runs)")
    parser.add_argument("--tapped", action="store_true",
                        help="a latent tap on the policy, as RLFR's flow reward puts one: no shared prompts padded")
    parser.add_argument("--csv", default=None, help="results CSV (default benchmarks/results/results.csv)")
    args = parser.parse_args()
    args.token_budget, args.lm_head_chunk = args.token_budget or None, args.lm_head_chunk or None
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        build_mid_policy(Path(tmp))
        model, tokenizer = load_backbone(tmp, "float32", False)
    prompts = first_prompts(args.prompts)
    torch.manual_seed(0)
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=args.new_tokens,
                             rollout_batch_size=len(prompts) * SAMPLES)
    rollouts = SampledRows(engine.generate(prompts, SAMPLES), tokenizer)
    lengths = rollouts.batch.response_lengths
    print(f"{rollouts.batch.batch_size} rows, response lengths: min {int(lengths.min())}, median "
          f"{int(lengths.median())}, max {int(lengths.max())}, mean {float(lengths.mean()):.1f}")
    optimizer = TorchOptimizer(torch.optim.SGD([{"params": list(model.parameters()), "name": "policy"}], lr=0.0))
    updates, experiences, scoring = {}, {}, {}
    for side, padding_free in SIDES.items():
        update = UpdateOptions(micro_batch_tokens=args.token_budget, padding_free=padding_free,
                               lm_head_chunk_size=args.lm_head_chunk)
        tap = LatentTap(model, [0.25, 0.5, 0.75]) if args.tapped else None
        actor = Actor(model, tap, None, None, update, LossOptions())
        maker = ExperienceMaker(actor, rollouts, grade, None, AdvantageOptions(), update, SamplingControls(), SAMPLES)
        start = time.perf_counter()
        experiences[side] = maker.make_experience(PromptBatch(prompts, [""] * len(prompts)), step=0)
        scoring[side] = time.perf_counter() - start
        updates[side] = PolicyUpdate(actor, update)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    padding: dict[str, float] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for side in SIDES:
            start = time.perf_counter()
            stats = updates[side].train_on(experiences[side], optimizer)
            if round_:
                times[side].append(time.perf_counter() - start)
            padding[side] = float(stats["perf/padding_frac"])
    median = {side: statistics.median(values) for side, values in times.items()}
    scored = min(scoring.values()) > 0.05  # on-policy GRPO without a reward model runs no scoring pass
    for side in SIDES:
        print(f"{side:>12}: update median {median[side]:.3f} s over {args.rounds} rounds "
              f"({', '.join(f'{t:.2f}' for t in times[side])}), "
              + (f"scoring pass {scoring[side]:.2f} s, " if scored else "")
              + f"perf/padding_frac {padding[side]:.3f}")
    ratio = median["padded"] / median["padding_free"]
    flop = {side: matmul_gflop(model, experiences[side].attention_mask, experiences[side].response_mask,
                               args.token_budget, padding_free, args.lm_head_chunk is not None)
            for side, padding_free in SIDES.items()}
    print(f"update phase padded / padding-free: {ratio:.2f}x (acceptance >= 1.5x); "
          + (f"scoring pass {scoring['padded'] / scoring['padding_free']:.2f}x" if scored else "no scoring pass"))
    print(f"matmul and attention work: padded {flop['padded']:.0f} GFLOP, padding-free {flop['padding_free']:.0f}: "
          f"a ceiling of {flop['padded'] / flop['padding_free']:.2f}x on this model and these lengths")
    append_csv(args.csv, {"bench": "packing", "time": timestamp(), "rows": rollouts.batch.batch_size,
                          "new_tokens": args.new_tokens, "token_budget": args.token_budget, "tapped": args.tapped,
                          "lm_head_chunk": args.lm_head_chunk,
                          "padded_update_s": median["padded"], "padding_free_update_s": median["padding_free"],
                          "padded_padding_frac": padding["padded"], "update_speedup": ratio,
                          "flop_ceiling": flop["padded"] / flop["padding_free"]})


if __name__ == "__main__":
    main()
