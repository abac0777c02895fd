"""`RolloutDataModule`: prompt batches for RL, expert solutions for offline flow pretraining, eval splits."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from flowkit.data.records import load_records
from flowkit.llm.backbone import ASSETS

BUNDLED_ARITHMETIC = ASSETS / "arithmetic"


def resolve_data_path(path: str) -> Path:
    """``bundled:NAME/split.jsonl`` → a file under ``flowkit/assets``; anything else unchanged."""
    if path.startswith("bundled:"):
        return ASSETS / path.removeprefix("bundled:")
    return Path(path).expanduser()


def _normalize(record: dict[str, Any], prompt_key: str, answer_key: str, solution_key: str | None,
               template: str) -> dict[str, str]:
    row = {"prompt": template.replace("{prompt}", str(record[prompt_key])), "answer": str(record[answer_key])}
    if solution_key is not None and solution_key in record:
        row["solution"] = str(record[solution_key])
    return row


def collate_records(rows: list[dict[str, str]]) -> dict[str, list[str]]:
    return {key: [row[key] for row in rows] for key in rows[0]}


class PromptStream(IterableDataset):
    """Endless prompt batches: batch ``i`` is a pure function of ``(seed, i)``.

    Epochs are reshuffled with ``seed + epoch``; iteration starts at ``start_index`` so a resumed run
    continues with exactly the batch the interrupted run would have drawn next. With ``world_size``
    ranks, rank ``r`` draws batch ``i·world_size + r`` of that sequence at step ``i`` (disjoint data).
    """

    def __init__(self, records: list[dict[str, str]], batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1):
        if len(records) < batch_size:
            raise ValueError(f"{len(records)} training prompts cannot fill a batch of {batch_size}")
        self.records, self.batch_size, self.seed = records, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.start_index = 0

    def batch(self, index: int) -> dict[str, Any]:
        per_epoch = len(self.records) // self.batch_size
        epoch, offset = divmod(index * self.world_size + self.rank, per_epoch)
        order = list(range(len(self.records)))
        random.Random(self.seed + epoch).shuffle(order)
        rows = [self.records[i] for i in order[offset * self.batch_size:(offset + 1) * self.batch_size]]
        return {**collate_records(rows), "index": index}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        index = self.start_index
        while True:
            yield self.batch(index)
            index += 1


class RolloutDataModule(L.LightningDataModule):
    """Prompts (+ reference answers and, for offline flow pretraining, expert solutions).

    Args:
        train_path: JSONL / parquet / ``datasets`` dir of training prompts, or ``bundled:arithmetic/train.jsonl``.
        val_path: held-out split for ``validate`` (pass@1 / pass@k).
        eval_paths: extra named eval sets, e.g. ``{math500: ../shared/data/math_eval/math500.jsonl}``;
            rows use ``problem`` or ``prompt`` and ``answer``.
        prompt_key, answer_key, solution_key: field names in the training data.
        prompt_template: how a prompt is shown to the policy; ``{prompt}`` is replaced by the record's
            prompt (e.g. a chat template with a "put your final answer within \\boxed{}" instruction).
        batch_size: prompts per RL step (each is sampled ``n`` times by the policy).
        val_batch_size: prompts per validation batch.
        max_val_examples: cap on each eval set (``None`` for all).
        on_error: ``raise`` on a bad record, or ``skip`` it and log a count.
        seed: shuffling seed of the training stream.
    """

    def __init__(
        self,
        train_path: str = "bundled:arithmetic/train.jsonl",
        val_path: str | None = "bundled:arithmetic/val.jsonl",
        eval_paths: dict[str, str] | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        solution_key: str | None = "solution",
        prompt_template: str = "{prompt}",
        batch_size: int = 8,
        val_batch_size: int = 64,
        max_val_examples: int | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        seed: int = 0,
    ):
        super().__init__()
        self.train_path, self.val_path, self.eval_paths = train_path, val_path, dict(eval_paths or {})
        self.prompt_key, self.answer_key, self.solution_key = prompt_key, answer_key, solution_key
        self.prompt_template = prompt_template
        self.batch_size, self.val_batch_size, self.max_val_examples = batch_size, val_batch_size, max_val_examples
        self.on_error, self.seed = on_error, seed
        self.train_records: list[dict[str, str]] = []
        self.val_sets: dict[str, list[dict[str, str]]] = {}
        self.next_index = 0

    def _load(self, path: str, prompt_key: str, answer_key: str, solution_key: str | None) -> list[dict[str, str]]:
        records = load_records(resolve_data_path(path), [prompt_key, answer_key], self.on_error)
        return [_normalize(r, prompt_key, answer_key, solution_key, self.prompt_template) for r in records]

    def _load_eval(self, path: str) -> list[dict[str, str]]:
        first = load_records(resolve_data_path(path), [], "raise")[:1]
        prompt_key = self.prompt_key if not first or self.prompt_key in first[0] else "problem"
        rows = self._load(path, prompt_key, self.answer_key, None)
        return rows[: self.max_val_examples] if self.max_val_examples else rows

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit") and not self.train_records:
            self.train_records = self._load(self.train_path, self.prompt_key, self.answer_key, self.solution_key)
        if not self.val_sets:
            sources = ({"heldout": self.val_path} if self.val_path else {}) | self.eval_paths
            self.val_sets = {name: self._load_eval(path) for name, path in sources.items()}

    @property
    def val_names(self) -> list[str]:
        return list(self.val_sets)

    def train_dataloader(self) -> DataLoader:
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        stream = PromptStream(self.train_records, self.batch_size, self.seed, rank, world_size)
        stream.start_index = self.next_index
        return DataLoader(stream, batch_size=None)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(rows, batch_size=self.val_batch_size, collate_fn=collate_records) for rows in self.val_sets.values()]

    def expert_batches(self, batch_size: int, seed: int) -> Iterator[dict[str, list[str]]]:
        """Endless shuffled batches of (prompt, solution) pairs for offline flow pretraining."""
        rows = [r for r in self.train_records if "solution" in r]
        if not rows:
            raise ValueError(f"offline flow pretraining needs a {self.solution_key!r} field in {self.train_path}")
        stream = PromptStream(rows, min(batch_size, len(rows)), seed)
        yield from iter(stream)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is not None and self.trainer.training and isinstance(batch, dict) and "index" in batch:
            self.next_index = int(batch["index"]) + 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"next_index": self.next_index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next_index = int(state_dict["next_index"])
