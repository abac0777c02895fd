"""`RolloutDataModule`: prompt batches for RL, expert solutions for offline flow pretraining, eval splits."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning as L
from lightning.pytorch.callbacks import Timer
from torch.utils.data import DataLoader, IterableDataset
from transformers import PreTrainedTokenizerBase

from flowkit.data.records import LOAD_DATASET_PREFIX, RecordError, load_records, strings_in
from flowkit.errors import ConfigError, check_range
from flowkit.llm.backbone import ASSETS
from flowkit.llm.chat import PROMPT_FORMATS, PromptFormat, format_prompt, is_conversation, resolve_prompt_format
from flowkit.seeding import run_seed

log = logging.getLogger(__name__)

BUNDLED_ARITHMETIC = ASSETS / "arithmetic"


def resolve_data_path(path: str) -> Path | str:
    """``bundled:NAME/split.jsonl`` → a file under ``flowkit/assets``; a ``hf:`` load_dataset spec stays a string."""
    if path.startswith("bundled:"):
        return ASSETS / path.removeprefix("bundled:")
    if path.startswith(LOAD_DATASET_PREFIX):
        return path
    return Path(path).expanduser()


def _check_lengths(record: dict[str, Any], fields: list[str], budget: tuple[int | None, int, int]) -> None:
    """Characters first: no text field may hold more characters than the policy's context holds as tokens (one token
    covers at most the tokenizer's longest vocabulary entry), so nothing is tokenized that cannot fit anyway —
    tokenizing a 64 MB field takes minutes and tens of GB."""
    context, _, longest_token = budget
    if context is None:
        return
    for field in fields:
        length = sum(map(len, strings_in(record.get(field))))
        if length > context * longest_token:
            raise ValueError(f"field {field!r} is {length} characters, at least {-(-length // longest_token)} tokens: "
                             f"beyond the policy's context of {context} tokens (max_position_embeddings)")


def _max_line_bytes(budget: tuple[int | None, int, int] | None) -> int | None:
    """The longest JSONL line worth reading, so one line cannot fill memory: 16 bytes for each character the policy's
    context holds, plus 1 MiB for other fields (None without a context). The fields themselves are bounded by
    :func:`_check_lengths`; this only has to be loose enough never to refuse a record they would accept."""
    if budget is None or budget[0] is None:
        return None
    context, _, longest_token = budget
    return 16 * context * longest_token + 2**20


def _normalize(record: dict[str, Any], prompt: str, answer_key: str, solution_key: str | None) -> dict[str, str]:
    row = {"prompt": prompt, "answer": str(record[answer_key])}
    if solution_key is not None and solution_key in record:
        row["solution"] = str(record[solution_key])
    return row


def collate_records(rows: list[dict[str, str]]) -> dict[str, list[str]]:
    """The fields every row has, as lists (a ``solution`` only some records carry is not a batch column)."""
    return {key: [row[key] for row in rows] for key in rows[0] if all(key in row for row in rows)}


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
        self._order: tuple[int, list[int]] | None = None  # (epoch, its permutation): shuffled once per epoch

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.records)))
            random.Random(self.seed + epoch).shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def batch(self, index: int) -> dict[str, Any]:
        per_epoch = len(self.records) // self.batch_size
        epoch, offset = divmod(index * self.world_size + self.rank, per_epoch)
        order = self._epoch_order(epoch)
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
        train_path: JSONL / parquet / ``datasets`` dir of training prompts, ``bundled:arithmetic/train.jsonl``, or a
            ``datasets.load_dataset`` spec ``hf:NAME?split=train`` (hub id or local data dir; also for the eval paths).
        val_path: held-out split for ``validate`` (pass@1 / pass@k).
        eval_paths: extra named eval sets, e.g. ``{math500: bundled:math_eval/math500.jsonl}`` (any name but
            ``heldout``, dots included: ``gsm8k.test``; MATH500, AMC23,
            AIME24 and AIME25 ship with flowkit); rows use ``problem`` or ``prompt`` and ``answer``.
        prompt_key, answer_key, solution_key: field names in the training data.
        prompt_format: how a prompt record becomes the policy's input (:mod:`flowkit.llm.chat`): ``chat`` renders
            it with the policy tokenizer's chat template (``apply_chat_template(..., add_generation_prompt=True)``;
            a string prompt is one user message, a conversational record ``[{"role", "content"}, ...]`` is used
            as it is); ``text`` uses ``prompt_template`` alone; ``auto`` (default) is ``chat`` when the tokenizer
            has a chat template (instruct models), else ``text``.
        prompt_template: the text of a string prompt, ``{prompt}`` replaced by the record's prompt (e.g. with a
            "put your final answer within \\boxed{}" instruction); in ``chat`` format, the user message's text.
            It must hold ``{prompt}``.
        batch_size: prompts per RL step (optimizer step) across all ranks, as in the paper (128 prompts × n
            samples); each of the W ranks takes ``batch_size / W`` of them (it must divide).
        val_batch_size: prompts per validation batch.
        max_val_examples: cap on each eval set (``None`` for all).
        on_error: ``raise`` on a bad record, or ``skip`` it and log a count. Records are checked in ``setup``
            (:func:`~flowkit.data.records.load_records`); with the trained module's tokenizer, no text field
            (prompt, answer, solution) may hold more characters than the model's context can hold as tokens
            (checked before anything is tokenized), a prompt must encode and, with the module's ``max_new_tokens``,
            fit its model's context (``max_position_embeddings``); prompts are never truncated. Fewer usable
            training records than ``batch_size`` is an error.
        seed: shuffling seed of the training stream; ``None`` (default): the run's global seed
            (``seed_everything``), so one seed varies the prompt order too; an int pins it.
        record_fields: the records' other fields that each row keeps, which the reward functions and an agent
            episode's environment read as columns (``guess_number``'s ``secret``, ``low``, ``high``,
            ``max_guesses``); every record must have them.
    """

    def __init__(
        self,
        train_path: str = "bundled:arithmetic/train.jsonl",
        val_path: str | None = "bundled:arithmetic/val.jsonl",
        eval_paths: dict[str, str] | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        solution_key: str | None = "solution",
        prompt_format: PromptFormat = "auto",
        prompt_template: str = "{prompt}",
        batch_size: int = 8,
        val_batch_size: int = 64,
        max_val_examples: int | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        seed: int | None = None,
        record_fields: list[str] | None = None,
    ):
        super().__init__()
        check_range("RolloutDataModule", "batch_size", batch_size, 1)
        check_range("RolloutDataModule", "val_batch_size", val_batch_size, 1)
        check_range("RolloutDataModule", "max_val_examples", max_val_examples, 1)
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"RolloutDataModule.on_error must be 'raise' or 'skip', got {on_error!r}")
        self.train_path, self.val_path, self.eval_paths = train_path, val_path, dict(eval_paths or {})
        if val_path and "heldout" in self.eval_paths:  # the val_path's name: one would silently replace the other
            raise ConfigError("RolloutDataModule.eval_paths cannot name a set 'heldout', the name of val_path's set: "
                              "rename it, or pass it as val_path")
        self.prompt_key, self.answer_key, self.solution_key = prompt_key, answer_key, solution_key
        self.record_fields = list(record_fields or [])
        taken = sorted(set(self.record_fields) & {"prompt", "answer", "solution", "index"})
        if taken:
            raise ConfigError(f"RolloutDataModule.record_fields cannot name {', '.join(map(repr, taken))}: the row "
                              "holds it already (prompt_key, answer_key and solution_key choose its source)")
        if prompt_format not in PROMPT_FORMATS:
            raise ConfigError(f"RolloutDataModule.prompt_format must be one of {', '.join(PROMPT_FORMATS)}, "
                              f"got {prompt_format!r}")
        if not isinstance(prompt_template, str) or "{prompt}" not in prompt_template:
            raise ConfigError(f"RolloutDataModule.prompt_template must be a string holding {{prompt}}, got "
                              f"{prompt_template!r}")
        self.prompt_format, self.prompt_template = prompt_format, prompt_template
        self.tokenizer: PreTrainedTokenizerBase | None = None  # the policy's (see use_module)
        self._module: L.LightningModule | None = None
        self._resolved_format: Literal["chat", "text"] | None = None  # prompt_format with `auto` decided, in setup
        self.batch_size, self.val_batch_size, self.max_val_examples = batch_size, val_batch_size, max_val_examples
        self.on_error, self.seed = on_error, run_seed(seed)
        self.train_records: list[dict[str, str]] = []
        self.val_sets: dict[str, list[dict[str, str]]] = {}
        self.next_index = 0

    def _load(self, path: str, prompt_key: str, answer_key: str, solution_key: str | None) -> list[dict[str, str]]:
        required, text = self._record_fields(prompt_key, answer_key, solution_key)
        budget = self._token_budget()

        def convert(record: dict[str, Any]) -> dict[str, Any]:
            if budget is not None:
                _check_lengths(record, [prompt_key, *text], budget)
            prompt = self._checked_prompt(record, prompt_key, solution_key, budget)
            return self._row(record, prompt, answer_key, solution_key)

        return list(load_records(resolve_data_path(path), required, self.on_error, text, convert,
                                 _max_line_bytes(budget)))

    def _record_fields(self, prompt_key: str, answer_key: str, solution_key: str | None) -> tuple[list[str], list[str]]:
        """(the fields a record must have, its text fields besides the prompt: a number there becomes text)."""
        return [prompt_key, answer_key, *self.record_fields], [answer_key] + ([solution_key] if solution_key else [])

    def _row(self, record: dict[str, Any], prompt: str, answer_key: str, solution_key: str | None) -> dict[str, Any]:
        """What the module reads of a checked record: its rendered ``prompt``, ``answer`` and ``solution``; every key
        but ``prompt``, ``answer`` and ``index`` reaches the reward model as a column (``RolloutBatch.columns``): here
        :attr:`record_fields`."""
        return {**_normalize(record, prompt, answer_key, solution_key),
                **{key: record[key] for key in self.record_fields}}

    def _checked_prompt(self, record: dict[str, Any], prompt_key: str, solution_key: str | None,
                        budget: tuple[int | None, int, int] | None) -> str:
        """The record's prompt as the policy sees it. A prompt is text (a number becomes text) or a conversation. With
        the policy's tokenizer (``budget`` from :meth:`_token_budget`) it must encode, and its tokens plus
        ``max_new_tokens`` must fit the policy's context, as must prompt plus expert solution: prompts are never
        truncated."""
        prompt = record[prompt_key]
        if isinstance(prompt, bool) or (not isinstance(prompt, (str, int, float)) and not is_conversation(prompt)):
            raise ValueError(f"field {prompt_key!r} must be a string or a conversation [{{'role': ..., 'content': "
                             f"...}}, ...], got {type(prompt).__name__} {repr(prompt)[:40]}")
        text = self._format_prompt(prompt)
        if budget is None:
            return text
        context, max_new_tokens, _ = budget
        try:
            length = len(self.tokenizer(text)["input_ids"])
        except Exception as err:  # the Rust tokenizers raise TypeError / pyo3 exceptions for text they cannot take
            raise ValueError(f"the tokenizer cannot encode the prompt ({type(err).__name__}: {err})") from None
        if context is not None and length + max_new_tokens > context:
            raise ValueError(f"the prompt is {length} tokens; with max_new_tokens {max_new_tokens} it exceeds the "
                             f"policy's context of {context} tokens (max_position_embeddings)")
        if context is not None and solution_key in record:
            total = length + len(self.tokenizer(record[solution_key], add_special_tokens=False)["input_ids"])
            if total > context:
                raise ValueError(f"prompt and {solution_key!r} are {total} tokens, beyond the policy's context of "
                                 f"{context} tokens (max_position_embeddings)")
        return text

    def _token_budget(self) -> tuple[int | None, int, int] | None:
        """With a tokenizer: (the trained model's context in tokens or None, the module's ``sampling.max_new_tokens`` or 0,
        the most characters one token covers, its longest vocabulary entry); else None."""
        if self.tokenizer is None:
            return None
        module = self._module
        model = getattr(module, "policy", None) or getattr(module, "backbone", None)
        context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        max_new_tokens = int(getattr(getattr(module, "sampling", None), "max_new_tokens", 0))
        return context, max_new_tokens, max(map(len, self.tokenizer.get_vocab()), default=1)

    def _format_prompt(self, prompt: Any) -> str:
        return format_prompt(prompt, self.tokenizer, self._resolved_format, self.prompt_template)

    def _load_eval(self, path: str) -> list[dict[str, str]]:
        max_line_bytes = _max_line_bytes(self._token_budget())
        first = load_records(resolve_data_path(path), [], "raise", max_line_bytes=max_line_bytes)[:1]
        prompt_key = self.prompt_key if not first or self.prompt_key in first[0] else "problem"
        rows = self._load(path, prompt_key, self.answer_key, None)
        return rows[: self.max_val_examples] if self.max_val_examples else rows

    def use_module(self, module: L.LightningModule) -> None:
        """Render and check prompts for ``module``: its tokenizer (chat template), context length, max_new_tokens.

        ``setup`` takes the trained module; the CLI calls this and ``setup`` before the Trainer is built, so a bad
        record is reported before any work starts."""
        self._module = module
        self.tokenizer = getattr(module, "tokenizer", None)

    def setup(self, stage: str | None = None) -> None:
        if self._module is None and self.trainer is not None:
            self.use_module(self.trainer.lightning_module)
        self._resolved_format = resolve_prompt_format(self.prompt_format, self.tokenizer)
        if stage in (None, "fit") and not self.train_records:
            self.train_records = self._load(self.train_path, self.prompt_key, self.answer_key, self.solution_key)
            if len(self.train_records) < self.batch_size:
                raise RecordError(f"{resolve_data_path(self.train_path)}: {len(self.train_records)} usable record(s) "
                                  f"cannot fill one batch of RolloutDataModule.batch_size {self.batch_size}")
        if not self.val_sets:
            sources = ({"heldout": self.val_path} if self.val_path else {}) | self.eval_paths
            self.val_sets = {name: self._load_eval(path) for name, path in sources.items()}

    @property
    def val_names(self) -> list[str]:
        return list(self.val_sets)

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        if trainer is not None and trainer.max_steps < 0 and not isinstance(trainer.limit_train_batches, int) and not any(
                isinstance(callback, Timer) or getattr(callback, "ends_fit", False) for callback in trainer.callbacks):
            raise ConfigError(f"{type(self).__name__} draws prompt batches without end (each epoch reshuffled): set "
                              "trainer.max_steps (or max_time) for the run to end")
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        stream = PromptStream(self.train_records, self.per_rank_batch_size(world_size), self.seed, rank, world_size)
        stream.start_index = self.next_index
        return DataLoader(stream, batch_size=None)

    def extra_batch(self, index: int, draw: int) -> dict[str, Any]:
        """Extra draw ``draw`` ≥ 1 of step ``index`` (dynamic sampling): this rank's batch ``index`` of the training
        stream reshuffled with its own seed per draw — a pure function of (seed, index, draw), so a resumed run draws
        the same, and the main stream is not advanced (verl draws on from its one dataloader instead)."""
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        stream = PromptStream(self.train_records, self.per_rank_batch_size(world_size), self.seed + 7919 * draw, rank,
                              world_size)
        return stream.batch(index)

    def per_rank_batch_size(self, world_size: int) -> int:
        """Prompts each rank draws per step: ``batch_size`` is the global batch of all ``world_size`` ranks."""
        if self.batch_size % world_size:
            raise ConfigError(f"RolloutDataModule.batch_size ({self.batch_size}, prompts per step across all ranks) "
                              f"must be divisible by the number of ranks ({world_size})")
        return self.batch_size // world_size

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(rows, batch_size=self.val_batch_size, collate_fn=collate_records) for rows in self.val_sets.values()]

    def expert_batches(self, batch_size: int, seed: int) -> Iterator[dict[str, list[str]]]:
        """Endless shuffled batches of (prompt, solution) pairs for offline flow pretraining."""
        rows = [r for r in self.train_records if "solution" in r]
        if not rows:  # raised here, when pretraining asks for its batches, before its first step
            raise RecordError(f"{resolve_data_path(self.train_path)}: offline flow pretraining (flow_pretrain.steps > 0)"
                              f" needs expert solutions, and no record has a {self.solution_key!r} field")
        if len(rows) < len(self.train_records):
            log.warning("%s: offline flow pretraining uses the %d of %d records that have a %r field",
                        resolve_data_path(self.train_path), len(rows), len(self.train_records), self.solution_key)
        return iter(PromptStream(rows, min(batch_size, len(rows)), seed))

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is not None and self.trainer.training and isinstance(batch, dict) and "index" in batch:
            self.next_index = int(batch["index"]) + 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"next_index": self.next_index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next_index = int(state_dict["next_index"])
