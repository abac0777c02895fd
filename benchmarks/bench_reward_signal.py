"""Does the flow reward carry token-level signal? AUROC of the flow's deviation at planted and at real errors.

Planted errors: one wrong character in held-out expert solutions of the bundled addition task, of four kinds —
an operand digit, a digit of a step's sum, the carry, a digit of the boxed answer. Each clean solution and its
corrupted copy are scored in identical batches (clean rows in one, corrupted rows in the other, same layout)
with one shared noise seed, so the two differ only by the planted character. Reported per kind: AUROC of
corrupted vs clean at the corrupted token for the raw deviation R_CFM (eq. 7), for the eq. 10 penalty (−r_k),
and, as a reference point, for the policy's own surprisal −log π(a_k); plus the deviation one token before.

Real errors: the policy's own samples (T = 1) on held-out prompts; a wrong sample's first wrong token (first
character differing from the expert solution) vs the tokens at the same response position in correct samples.

Both for the offline-pretrained flow and, with ``--rl-steps N``, for the flow (and policy) after the tiny RLFR
job (configs/rlfr_tiny.yaml with this script's flow options). Rows are appended to benchmarks/results/results.csv
(bench ``reward_signal``). Example::

    python benchmarks/bench_reward_signal.py --condition previous --rl-steps 60
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

import torch
import yaml

from flowkit.data.grader import grade
from flowkit.data.records import load_records
from flowkit.llm.backbone import load_backbone
from flowkit.llm.latent_tap import LatentTap
from flowkit.rewards.flow.expert_latents import ExpertLatentCache
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.packing import encode_pairs
from flowkit.modules.datamodule import PromptStream, resolve_data_path
from flowkit.modules.optim import flow_pretraining_schedule
from flowkit.rewards import FlowReward
from flowkit.rewards.flow import LatentOptions, NetworkOptions, ScoringOptions, PretrainingOptions
from flowkit.rewards.flow.scoring import flow_token_rewards

try:
    from common import append_csv
except ImportError:  # run as a module from the repo root
    from benchmarks.common import append_csv

KINDS = ("operand", "sum", "carry", "boxed")
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "rlfr_tiny.yaml"


def error_positions(solution: str) -> dict[str, list[int]]:
    """Character indices of each kind in ``a+b=s,c+d[+1]=s\\boxed{n}`` (the bundled solutions' format)."""
    boxed = solution.index("\\boxed{")
    positions: dict[str, list[int]] = {kind: [] for kind in KINDS}
    start = 0
    for step in solution[:boxed].split(","):
        lhs, rhs = step.split("=")
        terms, offset = lhs.split("+"), start
        for number, term in enumerate(terms):
            kind = "carry" if number == 2 else "operand"
            positions[kind] += range(offset, offset + len(term))
            offset += len(term) + 1
        positions["sum"] += range(start + len(lhs) + 1, start + len(step))
        start += len(step) + 1
    positions["boxed"] = list(range(boxed + len("\\boxed{"), len(solution) - 1))
    return positions


def plant(solution: str, kind: str, rng: random.Random) -> tuple[str, int] | None:
    """``solution`` with one digit of ``kind`` replaced by another digit, and the character index; None if absent."""
    candidates = error_positions(solution)[kind]
    if not candidates:
        return None
    index = rng.choice(candidates)
    wrong = rng.choice([d for d in "0123456789" if d != solution[index]])
    return solution[:index] + wrong + solution[index + 1:], index


def auroc(positive: torch.Tensor, negative: torch.Tensor) -> float:
    """P(positive > negative) + ½·P(tie) (Mann–Whitney)."""
    if positive.numel() == 0 or negative.numel() == 0:
        return float("nan")
    diff = positive.double()[:, None] - negative.double()[None, :]
    return float((diff > 0).double().mean() + 0.5 * (diff == 0).double().mean())


@torch.no_grad()
def score(model, tokenizer, tap: LatentTap, reward: FlowReward, prompts: list[str], responses: list[str],
          seed: int, batch_size: int = 256) -> dict[str, torch.Tensor]:
    """Per token (B×S): deviation R_CFM, eq. 10 reward, surprisal; plus the column where each response starts."""
    out: dict[str, list[torch.Tensor]] = {"deviation": [], "reward": [], "surprisal": []}
    starts = []
    batch = encode_pairs(tokenizer, prompts, responses)  # one layout (padding) for every chunk
    for begin in range(0, len(prompts), batch_size):
        rows = batch.select(list(range(begin, min(begin + batch_size, len(prompts)))))
        mask = rows.attention_mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with tap:
            logits = model(input_ids=rows.input_ids, attention_mask=mask, position_ids=positions).logits.float()
        logprobs = torch.zeros_like(rows.response_mask)
        logprobs[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, rows.input_ids[:, 1:, None]).squeeze(-1)
        # the chunk's scored tokens keep the noise they have in the whole batch (token-major counters)
        scored_before = int(reward.scored_token_counts(batch.response_mask[:begin]).sum()) if begin else 0
        deviation = reward.deviation_scores(tap.latents, rows.response_mask, seed, scored_before)
        scored = deviation != 0
        out["deviation"].append(deviation)
        scoring = reward.scoring
        out["reward"].append(flow_token_rewards(deviation, scored, scoring.eta, scoring.beta, scoring.top_k,
                                                scoring.normalization))
        out["surprisal"].append(-logprobs * rows.response_mask)
        starts.append(rows.response_mask.argmax(-1))
    result = {k: torch.cat(v) for k, v in out.items()}
    result["start"] = torch.cat(starts)
    return result


def planted_error_table(model, tokenizer, tap, reward, records, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for kind in KINDS:
        pairs = [(r, planted) for r in records if (planted := plant(r["solution"], kind, rng)) is not None]
        prompts = [r["prompt"] for r, _ in pairs]
        clean = score(model, tokenizer, tap, reward, prompts, [r["solution"] for r, _ in pairs], seed)
        corrupt = score(model, tokenizer, tap, reward, prompts, [p[0] for _, p in pairs], seed)
        at = clean["start"] + torch.tensor([p[1] for _, p in pairs])
        index = torch.arange(len(pairs))
        for metric, sign in (("deviation", 1), ("reward", -1), ("surprisal", 1)):
            for where, shift in (("wrong", 0), ("before", -1)):
                if metric != "deviation" and where == "before":
                    continue
                rows.append({"kind": kind, "metric": metric, "position": where, "n": len(pairs),
                             "auroc": auroc(sign * corrupt[metric][index, at + shift],
                                            sign * clean[metric][index, at + shift])})
    return rows


def own_sample_table(model, tokenizer, tap, reward, records, samples: int, seed: int) -> list[dict]:
    """The policy's wrong samples at their first wrong token vs correct samples at the same response position."""
    torch.manual_seed(seed)
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=28, temperature=1.0)
    batch = engine.generate([r["prompt"] for r in records], samples, [r["answer"] for r in records])
    expert = [r["solution"] for r in records for _ in range(samples)]
    correct = torch.tensor([grade(resp, ans) for resp, ans in zip(batch.responses, batch.answers)])
    scores = score(model, tokenizer, tap, reward, batch.prompts, batch.responses, seed)
    length = (scores["deviation"] != 0).sum(-1)

    def first_wrong(response: str, solution: str) -> int:
        return next((i for i, (a, b) in enumerate(zip(response, solution)) if a != b), min(len(response), len(solution)))

    wrong_rows = [(b, first_wrong(batch.responses[b], expert[b])) for b in range(len(expert)) if not correct[b]]
    rows = []
    for metric, sign in (("deviation", 1), ("reward", -1), ("surprisal", 1)):
        for where, shift in (("wrong", 0), ("before", -1)):
            if metric != "deviation" and where == "before":
                continue
            positive, negative = [], []
            for b, k in wrong_rows:
                k = k + shift
                if k < 0:
                    continue
                positive.append(sign * scores[metric][b, scores["start"][b] + k])
                peers = [c for c in range(len(expert)) if correct[c] and length[c] > k]
                negative += [sign * scores[metric][c, scores["start"][c] + k] for c in peers]
            rows.append({"kind": "own_samples", "metric": metric, "position": where, "n": len(positive),
                         "auroc": auroc(torch.stack(positive) if positive else torch.zeros(0),
                                        torch.stack(negative) if negative else torch.zeros(0))})
    rows[0]["accuracy"] = float(correct.float().mean())
    return rows


def pretrained_flow(args, model, tokenizer) -> tuple[FlowReward, LatentTap]:
    """The offline start of configs/rlfr_tiny.yaml (its batches, latent cache, AdamW and warmup-cosine schedule),
    with this script's flow options."""
    reward = flow_reward(args)
    tap = LatentTap(model, reward.percentiles)
    reward.bind(model, tap.layer_positions)
    train = load_records(resolve_data_path("bundled:arithmetic/train.jsonl"), ["prompt", "solution"])
    optimizer = torch.optim.AdamW(reward.parameters(), lr=args.flow_lr)
    schedule = flow_pretraining_schedule(optimizer, args.pretrain_steps, decay=args.pretrain_lr_decay)
    generator = torch.Generator().manual_seed(args.seed)
    batches = iter(PromptStream(train, args.pretrain_batch, args.seed))
    encode = ExpertLatentCache(model, tokenizer, tap, torch.device("cpu"))
    for _ in range(args.pretrain_steps):
        rows = next(batches)
        optimizer.zero_grad()
        for piece in reward.pretrain_losses(*encode(rows["prompt"], rows["solution"]), generator):
            piece().backward()
        optimizer.step()
        schedule.step()
    return reward, tap


def flow_reward(args) -> FlowReward:
    return FlowReward(latents=LatentOptions(percentiles=tuple(args.percentiles), condition=args.condition),
                      network=NetworkOptions(depth=args.depth, width=args.width),
                      scoring=ScoringOptions(timesteps=tuple(args.timesteps), eta=args.eta, top_k=args.top_k,
                                             normalization=args.normalization, noise_draws=args.noise_draws),
                      pretraining=PretrainingOptions(pretrain_timesteps=args.pretrain_copies,
                                                     pretrain_logit_mean=args.pretrain_logit_mean),
                      seed=args.seed)


def rl_trained(args):
    """configs/rlfr_tiny.yaml for ``--rl-steps`` steps with this script's flow options → (policy, tokenizer, tap, flow)."""
    from flowkit.cli import FlowkitCLI

    init = "--model.init_args.reward_model.init_args."
    overrides = ["--trainer.max_steps", str(args.rl_steps), "--trainer.limit_val_batches", "0",
                 "--seed_everything", str(args.seed), "--model.init_args.flow_pretrain.steps", str(args.pretrain_steps),
                 "--model.init_args.flow_pretrain.batch_size", str(args.pretrain_batch),
                 "--model.init_args.optim.flow_lr", str(args.flow_lr),
                 "--model.init_args.flow_pretrain.lr_decay", args.pretrain_lr_decay,
                 init + "latents.percentiles", str(args.percentiles), init + "network.depth", str(args.depth),
                 init + "scoring.timesteps", str(args.timesteps), init + "scoring.eta", str(args.eta),
                 init + "scoring.normalization", args.normalization, init + "latents.condition", args.condition,
                 init + "pretraining.pretrain_timesteps", str(args.pretrain_copies),
                 init + "pretraining.pretrain_logit_mean", str(args.pretrain_logit_mean),
                 init + "scoring.noise_draws", str(args.noise_draws),
                 init + "seed", str(args.seed)]
    if args.width:
        overrides += [init + "network.width", str(args.width)]
    if args.top_k:
        overrides += [init + "scoring.top_k", str(args.top_k)]
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as run_dir:
        os.chdir(run_dir)
        try:
            cli = FlowkitCLI(args=["fit", "--config", str(CONFIG), *overrides])
        finally:
            os.chdir(here)
    module = cli.model.eval()
    return module.policy, module.tokenizer, module.tap, module.reward_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # defaults: configs/rlfr_tiny.yaml's flow reward and pretraining
    config = yaml.safe_load(CONFIG.read_text())["model"]["init_args"]
    reward = config["reward_model"]["init_args"]
    flow = {name: value for key in ("latents", "network", "scoring", "online", "pretraining")
            for name, value in reward.get(key, {}).items()}  # each option under its own name
    parser.add_argument("--condition", default=flow["condition"], choices=["next", "previous", "none"])
    parser.add_argument("--percentiles", type=float, nargs="+", default=flow["percentiles"])
    parser.add_argument("--normalization", default=flow["normalization"], choices=["minmax", "bilateral", "mean"])
    parser.add_argument("--timesteps", type=float, nargs="+", default=flow["timesteps"])
    parser.add_argument("--depth", type=int, default=flow["depth"])
    parser.add_argument("--width", type=int, default=flow.get("width"))
    parser.add_argument("--eta", type=float, default=flow["eta"])
    parser.add_argument("--top-k", type=int, default=flow.get("top_k"))
    parser.add_argument("--noise-draws", type=int, default=flow.get("noise_draws", 1))
    parser.add_argument("--pretrain-steps", type=int, default=config["flow_pretrain"]["steps"])
    parser.add_argument("--pretrain-batch", type=int, default=config["flow_pretrain"]["batch_size"])
    parser.add_argument("--pretrain-copies", type=int, default=flow["pretrain_timesteps"])
    parser.add_argument("--pretrain-logit-mean", type=float, default=flow.get("pretrain_logit_mean", 0.0))
    parser.add_argument("--pretrain-lr-decay", default=config["flow_pretrain"].get("lr_decay", "cosine"),
                        choices=["cosine", "constant"])
    parser.add_argument("--flow-lr", type=float, default=float(config["optim"]["flow_lr"]))
    parser.add_argument("--examples", type=int, default=500, help="held-out solutions (bundled val split)")
    parser.add_argument("--samples", type=int, default=8, help="own samples per held-out prompt")
    parser.add_argument("--own-prompts", type=int, default=100)
    parser.add_argument("--rl-steps", type=int, default=0, help="also measure after this many RLFR steps (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    records = load_records(resolve_data_path("bundled:arithmetic/val.jsonl"), ["prompt", "solution", "answer"])

    model, tokenizer = load_backbone("bundled:tiny_adder")
    model.eval()
    torch.manual_seed(args.seed)
    reward, tap = pretrained_flow(args, model, tokenizer)
    flows = {"pretrained": (model, tokenizer, tap, reward)}
    if args.rl_steps:
        policy, tok, tap, reward = rl_trained(args)
        flows[f"rl{args.rl_steps}"] = (policy, tok, tap, reward)
    setting = (f"condition={args.condition} P={args.percentiles} norm={args.normalization} T={args.timesteps} "
               f"depth={args.depth} width={args.width} pretrain={args.pretrain_steps}x{args.pretrain_batch}"
               f"x{args.pretrain_copies} logit_mean={args.pretrain_logit_mean} decay={args.pretrain_lr_decay} "
               f"draws={args.noise_draws}")
    print(setting)
    print(f"{'flow':>11} {'kind':>11} {'metric':>10} {'position':>8} {'n':>5} {'AUROC':>6}")
    for name, (policy, tok, tap, reward) in flows.items():
        rows = planted_error_table(policy, tok, tap, reward, records[:args.examples], args.seed)
        rows += own_sample_table(policy, tok, tap, reward, records[:args.own_prompts], args.samples, args.seed)
        for row in rows:
            print(f"{name:>11} {row['kind']:>11} {row['metric']:>10} {row['position']:>8} {row['n']:>5} "
                  f"{row['auroc']:6.3f}" + (f"  (own-sample accuracy {row['accuracy']:.3f})" if "accuracy" in row else ""))
            append_csv(args.csv, {"bench": "reward_signal", "flow": name, "setting": setting, **row})


if __name__ == "__main__":
    main()
