"""Load prompt records from JSONL, parquet or a ``datasets.save_to_disk`` directory, with clear errors.

Every problem with the input is a :class:`RecordError` whose one-line message names the file and the
line (JSONL) or row (parquet, datasets): malformed JSON, a line that is not an object, a missing
required field, an empty or whitespace-only required value, bytes that are not UTF-8, a path that does
not exist (the message lists nearby files). With ``on_error="skip"`` bad records are dropped instead,
one warning reports how many, and the returned :class:`Records` carries the count as ``skipped``.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".parquet")


class RecordError(ValueError):
    """Bad input data; the message is one line naming the file and the line or row."""


class Records(list):
    """The loaded records (a list of dicts) plus ``skipped``, the number of bad records dropped."""

    def __init__(self, records: list[dict[str, Any]], skipped: int = 0):
        super().__init__(records)
        self.skipped = skipped


def load_records(
    path: str | Path,
    required: Sequence[str],
    on_error: Literal["raise", "skip"] = "raise",
) -> Records:
    """Read the records at ``path`` and check that every ``required`` field is present and non-empty.

    ``path`` is a ``.jsonl`` file (one JSON object per line; blank lines are ignored), a ``.parquet``
    file, or a directory written by ``datasets.Dataset.save_to_disk`` (needs ``datasets``).
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    path = Path(path)
    if not path.exists():
        raise RecordError(f"{path}: no such file or directory{_nearby(path)}")
    if path.is_dir():
        rows = _dataset_rows(path)
    elif path.suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif path.suffix == ".parquet":
        rows = _parquet_rows(path)
    else:
        raise RecordError(f"{path}: unsupported format {path.suffix!r}; expected one of {', '.join(SUFFIXES)} "
                          "or a datasets.save_to_disk directory")

    records, skipped, first_problem = [], 0, None
    for where, row in rows:
        try:
            if isinstance(row, RecordError):
                raise row
            _check_required(row, required, where)
        except RecordError as err:
            if on_error == "raise":
                raise
            skipped += 1
            first_problem = first_problem or str(err)
            continue
        records.append(row)
    if skipped:
        log.warning("%s: skipped %d bad record(s) of %d; first: %s", path, skipped, skipped + len(records),
                    first_problem)
    return Records(records, skipped)


def _check_required(row: dict[str, Any], required: Sequence[str], where: str) -> None:
    for field in required:
        if field not in row:
            raise RecordError(f"{where}: missing required field {field!r} (present: {', '.join(map(repr, row))})")
        value = row[field]
        if value is None or (isinstance(value, str) and not value.strip()):
            raise RecordError(f"{where}: required field {field!r} is empty")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any] | RecordError]]:
    """Yield ``(where, row)`` per non-blank line; a bad line yields its :class:`RecordError` instead."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield where, RecordError(f"{where}: not valid UTF-8 (byte {err.start} of the line)")
                continue
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                yield where, RecordError(f"{where}: malformed JSON ({err.msg} at column {err.colno})")
                continue
            if not isinstance(row, dict):
                yield where, RecordError(f"{where}: expected a JSON object, got {type(row).__name__}")
                continue
            yield where, row


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq
    from pyarrow import ArrowException

    try:
        table = pq.read_table(path)
    except (ArrowException, OSError) as err:
        raise RecordError(f"{path}: cannot read parquet ({_one_line(err)})") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}: row {number}", row


def _dataset_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
        raise RecordError(f"{path}: a directory that is not a datasets.save_to_disk dataset{_nearby(path / '_')}")
    try:
        import datasets
    except ImportError:
        raise RecordError(f"{path}: reading a saved dataset needs the 'datasets' package (pip install datasets)") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(str(path / name) for name in loaded)
        raise RecordError(f"{path}: holds several splits; point at one of: {splits}")
    for number, row in enumerate(loaded, start=1):
        yield f"{path}: row {number}", row


def _nearby(path: Path) -> str:
    """``; nearby: a, b, c`` — entries of the closest existing ancestor, most similar names first."""
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    try:
        names = sorted(p.name for p in parent.iterdir())
    except OSError:
        return ""
    if not names:
        return f"; {parent} is empty"
    close = difflib.get_close_matches(path.name, names, n=5, cutoff=0.0)
    shown = close + [n for n in names if n not in close][: max(0, 8 - len(close))]
    more = f" (+{len(names) - len(shown)} more)" if len(names) > len(shown) else ""
    return f"; nearby in {parent}: {', '.join(shown)}{more}"


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
