"""Load prompt records from JSONL, parquet or a ``datasets.save_to_disk`` directory, with clear errors.

Every problem with the input is a :class:`RecordError` whose one-line message names the file and the
line (JSONL) or row (parquet, datasets): malformed JSON, JSON nested too deeply to parse, a line that is not an
object, a missing required field, an empty or whitespace-only required value, a text field holding a list, object or
boolean (a number is converted with ``str``), text no tokenizer can encode (a lone UTF-16 surrogate such
as ``"\ud800"``), bytes that are not UTF-8, a JSONL line longer than ``max_line_bytes`` (never read into
memory whole), a path that does not exist (the message lists nearby files), and a file without any usable
record. With ``on_error="skip"`` bad records are dropped instead, one
warning reports how many, and the returned :class:`Records` carries the count as ``skipped``.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal

from flowkit.errors import ConfigError

log = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".parquet")
LOAD_DATASET_PREFIX = "hf:"


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
    text: Sequence[str] = (),
    convert: Callable[[dict[str, Any]], Any] | None = None,
    max_line_bytes: int | None = None,
) -> Records:
    """Read the records at ``path`` and check that every ``required`` field is present and non-empty.

    ``path`` is a ``.jsonl`` file (one JSON object per line; blank lines are ignored), a ``.parquet``
    file, a directory written by ``datasets.Dataset.save_to_disk`` (needs ``datasets``), or a
    ``datasets.load_dataset`` spec ``hf:NAME?split=...`` (see :func:`load_dataset_kwargs`). The ``text``
    fields, where present, must be strings; a finite number there is converted with ``str`` (``"answer": 46``) and a
    null or NaN counts as absent (``required`` fields must not be null or NaN).
    Every string in a record must be encodable as UTF-8. ``convert(record)``, if given, runs after these
    checks and its result is what is kept; a ``ValueError`` it raises is that record's problem (reported with its
    file and line, or skipped). A JSONL line longer than ``max_line_bytes`` is a bad record, read in pieces and
    dropped, so memory stays bounded whatever a line holds (parquet files and datasets are read whole).
    A path without any (usable) record is an error.
    """
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    spec, path = str(path), Path(path)
    if spec.startswith(LOAD_DATASET_PREFIX):
        rows = _load_dataset_rows(spec)
    elif not path.exists():
        raise RecordError(f"{path}: no such file or directory{_nearby(path)}")
    elif path.is_dir():
        rows = _dataset_rows(path)
    elif path.suffix == ".jsonl":
        rows = _jsonl_rows(path, max_line_bytes)
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
            _check_text(row, text, where)
            if convert is not None:
                try:
                    row = convert(row)
                except ValueError as err:
                    raise RecordError(f"{where}: {err}") from None
        except RecordError as err:
            if on_error == "raise":
                raise
            skipped += 1
            first_problem = first_problem or str(err)
            continue
        records.append(row)
    if not records:
        raise RecordError(f"{path}: no records" + (f" left after skipping {skipped} bad one(s); first: {first_problem}"
                                                   if skipped else ""))
    if skipped:
        log.warning("%s: skipped %d bad record(s) of %d; first: %s", path, skipped, skipped + len(records),
                    first_problem)
    return Records(records, skipped)


def _check_required(row: dict[str, Any], required: Sequence[str], where: str) -> None:
    for field in required:
        if field not in row:
            raise RecordError(f"{where}: missing required field {field!r} (present: {', '.join(map(repr, row))})")
        value = row[field]
        if _missing(value) or (isinstance(value, str) and not value.strip()):
            raise RecordError(f"{where}: required field {field!r} is empty"
                              + (f" ({value!r}, a missing value)" if isinstance(value, float) else ""))


def _missing(value: Any) -> bool:
    """null, or NaN: JSON's ``NaN`` and pandas' marker of a missing value, which ``str`` would make the text "nan"."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _check_text(row: dict[str, Any], text: Sequence[str], where: str) -> None:
    """Convert numbers in the ``text`` fields to strings and drop nulls there (an optional field left empty, as
    parquet writes it); refuse other non-strings and unencodable strings."""
    for field in text:
        value = row.get(field)
        if _missing(value):
            row.pop(field, None)
        elif isinstance(value, float) and math.isinf(value):
            raise RecordError(f"{where}: field {field!r} is {value!r}, not a finite number")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            row[field] = str(value)
        elif field in row and not isinstance(value, str):
            raise RecordError(f"{where}: field {field!r} must be a string (or a number), got {type(value).__name__}")
    for field, value in row.items():
        for string in strings_in(value):
            try:
                string.encode("utf-8")
            except UnicodeEncodeError as err:
                raise RecordError(f"{where}: field {field!r} is not encodable text ({err.reason} at character "
                                  f"{err.start})") from None


def strings_in(value: Any) -> Iterator[str]:
    """Every string inside a JSON value, without recursion (a parsed value may nest as deep as the parser went)."""
    pending = [value]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            pending.extend(reversed(value.values()))
        elif isinstance(value, list):
            pending.extend(reversed(value))


def _jsonl_rows(path: Path, max_line_bytes: int | None) -> Iterator[tuple[str, dict[str, Any] | RecordError]]:
    """Yield ``(where, row)`` per non-blank line; a bad line yields its :class:`RecordError` instead."""
    with path.open("rb") as f:
        for number, raw in enumerate(_lines(f, max_line_bytes), start=1):
            where = f"{path}:{number}"
            if raw is None:
                yield where, RecordError(f"{where}: the line is longer than {max_line_bytes} bytes, the most a record "
                                         "may take here")
                continue
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
            except RecursionError:  # the parser recurses per nesting level; Python's recursion limit ends it
                yield where, RecordError(f"{where}: JSON nested too deeply to parse (more than about "
                                         f"{sys.getrecursionlimit()} levels)")
                continue
            if not isinstance(row, dict):
                yield where, RecordError(f"{where}: expected a JSON object, got {type(row).__name__}")
                continue
            yield where, row


def _lines(f: BinaryIO, limit: int | None) -> Iterator[bytes | None]:
    """The lines of ``f``; in place of a line longer than ``limit`` bytes, ``None`` (the line is read in pieces)."""
    while line := (f.readline() if limit is None else f.readline(limit + 1)):
        if limit is not None and len(line) > limit:
            while line and not line.endswith(b"\n"):
                line = f.readline(1 << 20)
            yield None
        else:
            yield line


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


def load_dataset_kwargs(spec: str) -> dict[str, str]:
    """``hf:NAME?key=value&...`` → keyword arguments of ``datasets.load_dataset``.

    ``NAME`` is a hub id (``openai/gsm8k``) or a local directory of data files; the query sets ``split``
    (default ``train``; slices such as ``train[:1000]`` work) and any other string argument (``name`` for the
    dataset config, ``revision``, ``data_dir``). Example: ``hf:openai/gsm8k?name=main&split=test``.
    """
    name, _, query = spec.removeprefix(LOAD_DATASET_PREFIX).partition("?")
    if not name:
        raise RecordError(f"{spec}: no dataset name after {LOAD_DATASET_PREFIX!r} (e.g. hf:openai/gsm8k?split=train)")
    kwargs = {"path": name, "split": "train"}
    for item in filter(None, query.split("&")):
        key, sep, value = item.partition("=")
        if not sep or not key or key == "path":
            raise RecordError(f"{spec}: expected key=value pairs after '?', got {item!r}")
        kwargs[key] = value
    return kwargs


def _load_dataset_rows(spec: str) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise RecordError(f"{spec}: loading a datasets.load_dataset name needs the 'datasets' package "
                          "(pip install datasets)") from None
    kwargs = load_dataset_kwargs(spec)
    try:
        loaded = datasets.load_dataset(**kwargs)
    except Exception as err:  # datasets raises many types (not found, offline, bad split, bad files): one line each
        raise RecordError(f"{spec}: datasets.load_dataset failed ({type(err).__name__}: {_one_line(err)})") from None
    for number, row in enumerate(loaded, start=1):
        yield f"{spec}: row {number}", row


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
