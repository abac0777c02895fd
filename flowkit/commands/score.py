"""`flowkit score`: per-token flow rewards for given (prompt, response) pairs, as JSONL and an HTML heat map."""

from __future__ import annotations

import html
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowkit.checkpointing import load_trained_weights
from flowkit.registry import subcommand
from flowkit.data.records import load_records
from flowkit.errors import ConfigError
from flowkit.llm.rollout import encode_pairs


def render_html(rows: list[dict], title: str = "flowkit flow rewards") -> str:
    """Response tokens shaded by their flow reward (darker red = larger penalty), prompt in grey."""
    lowest = min((min(r["rewards"], default=0.0) for r in rows), default=0.0) or -1.0
    parts = [f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:monospace;max-width:60em;margin:2em auto}"
             ".row{margin:1.5em 0;white-space:pre-wrap}.prompt{color:#888}</style>",
             f"<h1>{html.escape(title)}</h1><p>Tokens shaded by flow reward r_k (eq. 10); hover for the value.</p>"]
    for row in rows:
        cells = []
        for token, reward, deviation in zip(row["tokens"], row["rewards"], row["deviations"]):
            alpha = min(1.0, reward / lowest) if reward < 0 else 0.0
            cells.append(f"<span style='background:rgba(220,40,40,{alpha:.2f})' "
                         f"title='reward {reward:.4g}, deviation {deviation:.4g}'>{html.escape(token)}</span>")
        parts.append(f"<div class='row'><span class='prompt'>{html.escape(row['prompt'])}</span>{''.join(cells)}</div>")
    return "\n".join(parts)


@subcommand("score")
@torch.no_grad()  # scoring only: no autograd graph over the policy and flow forwards
def score(
    trainer,
    model,
    datamodule,
    input: str,
    output: str = "flow_scores.jsonl",
    html_output: str | None = "flow_scores.html",
    checkpoint: str | None = None,
    batch_size: int = 16,
    step: int = 0,
):
    """Score (prompt, response) pairs with the policy's flow reward: per-token JSONL and an HTML page.

    Args:
        input: JSONL (or parquet) with ``prompt`` and ``response`` fields.
        output: where to write one JSON object per pair: tokens, flow rewards r_k, deviations R_CFM.
        html_output: where to write the colour-coded page (``null`` to skip).
            Missing parent directories of both outputs are created before any scoring work.
        checkpoint: a Lightning checkpoint of the PolicyModule (``.ckpt`` file or DeepSpeed ZeRO directory);
            default: the config's weights.
        batch_size: pairs per forward.
        step: the noise step (rewards use seed + 1000·step, as in training).
    """
    reward = getattr(model, "reward_model", None)
    if reward is None or not hasattr(reward, "deviation_scores"):
        raise SystemExit("flowkit score needs a PolicyModule whose reward_model is a FlowReward")
    outputs = [Path(path) for path in (output, html_output) if path]
    for path in outputs:  # before any work: a bad output path must not cost the scoring run
        if path.is_dir():
            raise ConfigError(f"score output {str(path)!r} is a directory, not a file")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"cannot create the directory of score output {str(path)!r}: {err.strerror}") from None
    records = load_records(input, ["prompt", "response"])
    if checkpoint:
        load_trained_weights(model, checkpoint)
    model.eval()
    rows = []
    for start in tqdm(range(0, len(records), batch_size), desc="scoring"):
        chunk = records[start:start + batch_size]
        batch = encode_pairs(model.tokenizer, [r["prompt"] for r in chunk], [r["response"] for r in chunk])
        batch = model.score_rollouts(batch.to(model.device))
        deviations = reward.deviation_scores(batch.latents, batch.response_mask, reward.seed + 1000 * step)
        rewards = reward.token_rewards(batch, step)
        for i, record in enumerate(chunk):
            positions = batch.response_mask[i].nonzero().flatten().tolist()
            rows.append({
                "prompt": record["prompt"],
                "response": record["response"],
                "tokens": [model.tokenizer.decode([int(batch.input_ids[i, p])]) for p in positions],
                "rewards": [float(rewards[i, p]) for p in positions],
                "deviations": [float(deviations[i, p]) for p in positions],
            })
    with open(output, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {len(rows)} scored responses to {output}")
    if html_output:
        Path(html_output).write_text(render_html(rows))
        print(f"wrote {html_output}")
