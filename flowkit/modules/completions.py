"""Completion logs (TRL's ``log_completions``, verl's ``log_val_generations``): a few of a step's rollouts with their
outcome rewards and per-token dense rewards, as JSONL, as the HTML heat map of ``flowkit score`` and as a logger table.

The flowkit CLI adds :class:`CompletionLogs` to every fit unless the config names its own (:func:`flowkit.cli.place_run`).
"""

from __future__ import annotations

import html
import itertools
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from flowkit.batch import RolloutBatch
from flowkit.errors import check_range


def render_html(rows: list[dict], title: str = "flowkit flow rewards",
                caption: str = "Tokens shaded by flow reward r_k (eq. 10); hover for the value.") -> str:
    """Response tokens shaded by their dense reward (darker red = larger penalty; a ``None`` reward is a token not
    scored), prompt in grey; a row's optional ``label`` heads it, its optional ``deviations`` (R_CFM) join each
    token's hover text and its optional ``roles`` (an agent episode's) set the environment's and the tools' tokens in
    blue, apart from the policy's."""
    lowest = min((min((r for r in row["rewards"] if r is not None), default=0.0) for row in rows), default=0.0) or -1.0
    parts = [f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:monospace;max-width:60em;margin:2em auto}"
             ".row{margin:1.5em 0;white-space:pre-wrap}.prompt{color:#888}.label{color:#446;font-weight:bold}"
             ".environment,.tool{color:#36c}</style>",
             f"<h1>{html.escape(title)}</h1><p>{html.escape(caption)}</p>"]
    for row in rows:
        parts.append(_row_html(row, lowest))
    return "\n".join(parts)


def _row_html(row: dict, lowest: float) -> str:
    deviations = row.get("deviations") or [None] * len(row["tokens"])
    roles = row.get("roles") or ["policy"] * len(row["tokens"])
    cells = []
    for token, reward, deviation, role in zip(row["tokens"], row["rewards"], deviations, roles):
        alpha = min(1.0, reward / lowest) if reward is not None and reward < 0 else 0.0
        hover = f"{role}: " * (role != "policy") + ("not scored" if reward is None else f"reward {reward:.4g}") + (
            "" if deviation is None else f", deviation {deviation:.4g}")
        cells.append(f"<span style='background:rgba(220,40,40,{alpha:.2f})' class='{role}' title='{hover}'>"
                     f"{html.escape(token)}</span>")
    label = f"<div class='label'>{html.escape(row['label'])}</div>" if row.get("label") else ""
    return f"<div class='row'>{label}<span class='prompt'>{html.escape(row['prompt'])}</span>{''.join(cells)}</div>"


def completion_rows(batch: RolloutBatch, tokenizer, count: int, step: int) -> list[dict[str, Any]]:
    """``count`` rollouts of ``batch`` spread over its prompts: the first sample of every group, then the second of
    every group, ... (so 8 rows of a step of 16 prompts show 8 prompts, not one prompt's group): prompt, completion,
    outcome reward, correctness, response tokens and their dense rewards (``None`` without a reward model); an agent
    episode's row also its ``episode`` (its turns: whose, their text and token ids; how it ended), its
    ``prompt_ids`` and each token's ``role`` — the record ``flowkit score`` re-scores an episode from."""
    order = spread_over_groups(batch.group_ids.cpu())[:count].tolist()
    rows = []
    for i in order:
        positions = batch.response_mask[i].nonzero().flatten().tolist()
        rewards = None if batch.token_rewards is None else [float(batch.token_rewards[i, p]) for p in positions]
        rows.append({
            "step": step,
            "group": int(batch.group_ids[i]),
            "prompt": batch.prompts[i],
            "completion": batch.responses[i],
            "outcome_reward": float(batch.outcome_rewards[i]),
            "correct": bool(batch.correct[i]),
            "tokens": [tokenizer.decode([int(batch.input_ids[i, p])]) for p in positions],
            "token_rewards": rewards,
        })
        if "episode" in batch.columns:  # an agent episode's row: its turns, and whose each response token is
            rows[-1].update(_episode_fields(batch, i, positions))
    return rows


def _episode_fields(batch: RolloutBatch, i: int, positions: list[int]) -> dict[str, Any]:
    """Row ``i``'s episode with each turn's token ids, its prompt's ids (``flowkit score`` re-scores them as sampled,
    never re-tokenized) and each response token's role."""
    episode = batch.columns["episode"][i]
    ids = batch.input_ids[i].tolist()
    prompt = (batch.attention_mask[i].bool() & ~batch.response_mask[i].bool()).nonzero().flatten().tolist()
    ends = itertools.accumulate(turn["tokens"] for turn in episode["turns"])
    turns = [{**turn, "ids": [ids[p] for p in positions[end - turn["tokens"]:end]]}
             for turn, end in zip(episode["turns"], ends)]
    return {"prompt_ids": [ids[p] for p in prompt], "episode": {**episode, "turns": turns},
            "roles": [turn["role"] for turn in turns for _ in range(turn["tokens"])]}


def spread_over_groups(group_ids: torch.Tensor) -> torch.Tensor:
    """Row indices in round-robin order over the groups: each group's first row (groups in ascending order), then
    each group's second row, ..."""
    by_group = torch.argsort(group_ids, stable=True)
    sorted_ids = group_ids[by_group]
    rank_in_group = torch.arange(len(by_group)) - torch.searchsorted(sorted_ids, sorted_ids)
    return by_group[torch.argsort(rank_in_group, stable=True)]  # stable: groups stay in ascending order


class CompletionLogs(L.Callback):
    """Every ``every_n_steps`` RL steps, rank 0 logs ``rows`` rollouts of the step (prompt, completion, outcome reward,
    correctness, the per-token dense rewards of the reward model, e.g. RLFR's flow rewards):

    - appended to ``<log dir>/completions.jsonl``, one object per rollout with its ``step``;
    - as ``<log dir>/completions/step_<N>.html``, the heat map of ``flowkit score`` (penalised tokens in red);
    - to the logger as a table where it has one: W&B (``log_table`` under ``completions``, with the heat map as an
      HTML column), TensorBoard (a Markdown table as text under ``completions``). Other loggers (CSV): files only.

    It reads the step's :class:`~flowkit.batch.RolloutBatch` that :class:`~flowkit.modules.PolicyModule` returns from
    ``training_step`` (``outputs["rollouts"]``); steps of other modules log nothing. RL step N (from 1) is the N-th
    prompt batch of the run, also after a resume.

    Args:
        every_n_steps: log on steps N, 2N, ...; 0 is off.
        rows: rollouts per logged step, spread over the step's prompts (:func:`spread_over_groups`).
    """

    def __init__(self, every_n_steps: int = 10, rows: int = 8):
        check_range("CompletionLogs", "every_n_steps", every_n_steps, 0)
        check_range("CompletionLogs", "rows", rows, 1)
        self.every_n_steps, self.rows = every_n_steps, rows
        self.log_dir: Path | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # `log_dir` is a broadcast: every rank asks here, where all of them run (only rank 0 writes).
        if stage == "fit":
            self.log_dir = Path(trainer.log_dir or trainer.default_root_dir)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        rollouts = outputs.get("rollouts") if isinstance(outputs, dict) else None
        if not self.every_n_steps or rollouts is None or not trainer.is_global_zero:
            return
        step = int(batch["index"]) + 1 if isinstance(batch, dict) and "index" in batch else batch_idx + 1
        if step % self.every_n_steps:
            return
        rows = completion_rows(rollouts, pl_module.tokenizer, self.rows, step)
        self.write(rows, step)
        for logger in trainer.loggers:
            log_table(logger, rows, trainer.global_step)

    def write(self, rows: list[dict[str, Any]], step: int) -> None:
        """completions.jsonl (appended) and completions/step_<step>.html under the log directory."""
        directory = self.log_dir / "completions"
        directory.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / "completions.jsonl", "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        (directory / f"step_{step:06d}.html").write_text(render_html(
            [_heat_map_row(row) for row in rows], title=f"flowkit completions, step {step}",
            caption="Response tokens shaded by their dense (flow) reward; hover for the value."))


def _heat_map_row(row: dict[str, Any]) -> dict[str, Any]:
    rewards = row["token_rewards"] or [0.0] * len(row["tokens"])
    label = f"group {row['group']} · outcome reward {row['outcome_reward']:.4g} · {'correct' if row['correct'] else 'wrong'}"
    if "episode" in row:
        turns = sum(turn["role"] == "policy" for turn in row["episode"]["turns"])
        label += f" · {turns} policy turns, ended: {row['episode']['stop_reason']}"
    return {"prompt": row["prompt"], "tokens": row["tokens"], "rewards": rewards, "label": label,
            "roles": row.get("roles")}


TABLE_COLUMNS = ["step", "group", "prompt", "completion", "outcome_reward", "correct", "dense_reward_sum"]


def _table_row(row: dict[str, Any]) -> list[Any]:
    dense = None if row["token_rewards"] is None else sum(row["token_rewards"])
    return [row["step"], row["group"], row["prompt"], row["completion"], row["outcome_reward"], row["correct"], dense]


def log_table(logger: Any, rows: list[dict[str, Any]], step: int) -> None:
    """``rows`` as a table on loggers that have one (W&B, TensorBoard), at the trainer's ``step`` (the x-axis of the
    module's other metrics); nothing on others."""
    if isinstance(logger, WandbLogger):
        import wandb

        lowest = min((min(r, default=0.0) for r in (_heat_map_row(row)["rewards"] for row in rows)), default=0.0) or -1.0
        data = [_table_row(row) + [wandb.Html(_row_html(_heat_map_row(row), lowest))] for row in rows]
        logger.log_table("completions", columns=TABLE_COLUMNS + ["heat_map"], data=data, step=step)
    elif isinstance(logger, TensorBoardLogger):
        cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
        lines += ["| " + " | ".join(cell(value) for value in _table_row(row)) + " |" for row in rows]
        logger.experiment.add_text("completions", "\n".join(lines), global_step=step)
