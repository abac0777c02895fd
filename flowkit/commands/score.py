"""`flowkit score`: per-token flow rewards of given (prompt, response) pairs and agent episodes, as JSONL and an HTML
heat map.

An episode is scored as the training step scores it (:mod:`flowkit.step.episodes`): one row, its prompt then every
turn, the forward reading all of it, so the environment's and the tools' tokens condition the latents of the
policy's tokens after them; the flow reward scores the policy's tokens alone (``RolloutBatch.loss_mask``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from flowkit.batch import RolloutBatch, prompt_aligned
from flowkit.checkpointing.safe_loading import load_trained_weights
from flowkit.registry import subcommand
from flowkit.data.records import load_records
from flowkit.errors import ConfigError
from flowkit.modules.completions import render_html
from flowkit.rewards.flow.reward import FlowReward
from flowkit.seeding import flow_noise_seed

ROLES = ("policy", "environment", "tool")  # whose an episode's turn is (flowkit.agents.trajectory.Role but "prompt")


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
    """Score (prompt, response) pairs and agent episodes with the policy's flow reward: per-token JSONL and an HTML
    page.

    Args:
        input: JSONL (or parquet) records, each a ``prompt`` with either a ``response`` or an ``episode`` (a
            completion log's row: ``{"turns": [{"role", "text", "ids"?}, ...]}``, roles policy / environment /
            tool, and the prompt's ``prompt_ids`` if known); the two kinds may be mixed.
        output: where to write one JSON object per record: tokens, their roles, flow rewards r_k and deviations
            R_CFM (null on an episode's environment and tool tokens, which are not scored).
        html_output: where to write the colour-coded page (``null`` to skip).
            Missing parent directories of both outputs are created before any scoring work.
        checkpoint: a Lightning checkpoint of the PolicyModule (``.ckpt`` file or DeepSpeed ZeRO directory);
            default: the config's weights.
        batch_size: records per forward.
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
    items = load_records(input, ["prompt"], text=["prompt", "response"], convert=record_encoder(model.tokenizer))
    if checkpoint:
        load_trained_weights(model, checkpoint)
    model.eval()
    rows = []
    for start in tqdm(range(0, len(items), batch_size), desc="scoring", disable=not sys.stderr.isatty()):
        chunk = items[start:start + batch_size]
        batch = model.score_rollouts(lay_out(chunk, model.tokenizer.pad_token_id or 0).to(model.device))
        deviations = reward.deviation_scores(batch.latents, batch.loss_mask, flow_noise_seed(reward.seed, step))
        rewards = reward.token_rewards(batch, step)
        for i, item in enumerate(chunk):
            rows.append(item.scored_row(model.tokenizer, batch, i, rewards, deviations))
    with open(output, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {len(rows)} scored records to {output}")
    if html_output:
        Path(html_output).write_text(render_html(rows))
        print(f"wrote {html_output}")


@dataclass(frozen=True)
class ScoredRecord:
    """An input record as token ids: its prompt's, then its response's as turns (role, ids) — a pair's response is
    one policy turn."""

    record: dict[str, Any]
    prompt_ids: list[int]
    turns: list[tuple[str, list[int]]]

    def scored_row(self, tokenizer: Any, batch: RolloutBatch, i: int, rewards: torch.Tensor,
                   deviations: torch.Tensor) -> dict[str, Any]:
        """The output row of row ``i`` of the scored ``batch``: the record's prompt and response or episode, then
        per response token its text, role, reward and deviation (None where the policy did not write it)."""
        positions = batch.response_mask[i].nonzero().flatten().tolist()
        roles = [role for role, ids in self.turns for _ in ids]
        scored = lambda values: [float(values[i, p]) if role == "policy" else None  # noqa: E731
                                 for p, role in zip(positions, roles)]
        row = {key: self.record[key] for key in ("prompt", "response", "episode") if self.record.get(key) is not None}
        return {**row, "tokens": [tokenizer.decode([int(batch.input_ids[i, p])]) for p in positions], "roles": roles,
                "rewards": scored(rewards), "deviations": scored(deviations)}


def record_encoder(tokenizer: Any) -> Callable[[dict[str, Any]], ScoredRecord]:
    """The ``load_records`` conversion of a record to its :class:`ScoredRecord`; a ``ValueError`` says what is wrong
    with it (``load_records`` names the record). Ids a record carries (a completion log's) are used as they are;
    text is encoded: a prompt as a single-turn prompt is (with the tokenizer's special tokens), a response with the
    EOS appended, an episode's turn by turn without special tokens (a turn's text holds its own, as the completion
    logs write it)."""
    vocabulary = len(tokenizer)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]

    def ids_of(value: Any, what: str) -> list[int]:
        if not isinstance(value, list) or not all(isinstance(i, int) and 0 <= i < vocabulary for i in value):
            raise ValueError(f"{what} must be a list of token ids in [0, {vocabulary})")
        return value

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def convert(record: dict[str, Any]) -> ScoredRecord:
        given = lambda key: record.get(key) is not None  # noqa: E731 - parquet writes an absent field as null
        if given("response") == given("episode"):
            raise ValueError("a record holds either a 'response' or an 'episode', got "
                             + ("both" if given("response") else f"neither (fields: {', '.join(record)})"))
        prompt_ids = (ids_of(record["prompt_ids"], "prompt_ids") if given("prompt_ids")
                      else tokenizer(record["prompt"])["input_ids"])
        if given("response"):
            if not record["response"].strip():
                raise ValueError("field 'response' is empty")
            return ScoredRecord(record, prompt_ids, [("policy", encode(record["response"]) + eos)])
        turns = _checked_turns(record["episode"])
        return ScoredRecord(record, prompt_ids, [
            (turn["role"], encode(turn["text"]) if turn.get("ids") is None else ids_of(turn["ids"], f"turn {n}'s ids"))
            for n, turn in enumerate(turns)])

    return convert


def _checked_turns(episode: Any) -> list[dict[str, Any]]:
    turns = episode.get("turns") if isinstance(episode, dict) else None
    if not isinstance(turns, list) or not turns:
        raise ValueError("'episode' must be an object with a non-empty list of 'turns', as the completion logs write")
    for number, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("text"), str):
            raise ValueError(f"turn {number} of the episode needs a 'role' ({' / '.join(ROLES)}) and a 'text' string, "
                             f"got {json.dumps(turn)[:80]}")
    if not any(turn["role"] == "policy" for turn in turns):
        raise ValueError("the episode has no policy turn: nothing to score")
    return turns


def lay_out(items: list[ScoredRecord], pad_id: int) -> RolloutBatch:
    """Rows ``[left padding][prompt][turns][right padding]``, as the training step lays out episodes: every turn is
    response (the forward reads it), ``policy_mask`` marks the policy's turns (the flow reward scores them)."""
    rows = prompt_aligned([item.prompt_ids + [token for _, turn in item.turns for token in turn] for item in items],
                          [len(item.prompt_ids) for item in items], pad_id)
    policy = rows.place([[0.0] * len(item.prompt_ids) + [float(role == "policy") for role, turn in item.turns
                                                          for _ in turn] for item in items], torch.float32)
    return RolloutBatch(input_ids=rows.input_ids, attention_mask=rows.attention_mask, response_mask=rows.response_mask,
                        group_ids=torch.arange(len(items)), prompts=[item.record["prompt"] for item in items],
                        policy_mask=policy)
