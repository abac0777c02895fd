"""`flowkit score`: per-token flow rewards for given (prompt, response) pairs, as JSONL and an HTML heat map."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowkit.checkpointing.safe_loading import load_trained_weights
from flowkit.registry import subcommand
from flowkit.data.records import load_records
from flowkit.errors import ConfigError
from flowkit.llm.packing import encode_pairs
from flowkit.modules.completions import render_html
from flowkit.rewards.flow.reward import FlowReward
from flowkit.seeding import flow_noise_seed


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
        step: the noise step (:func:`~flowkit.seeding.flow_noise_seed`, as in training).
    """
    reward = getattr(model, "reward_model", None)
    if not isinstance(reward, FlowReward):
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
    for start in tqdm(range(0, len(records), batch_size), desc="scoring", disable=not sys.stderr.isatty()):
        chunk = records[start:start + batch_size]
        batch = encode_pairs(model.tokenizer, [r["prompt"] for r in chunk], [r["response"] for r in chunk])
        batch = model.score_rollouts(batch.to(model.device))
        deviations = reward.deviation_scores(batch.latents, batch.response_mask, flow_noise_seed(reward.seed, step))
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
