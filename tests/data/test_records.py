import json
import logging
import sys

import pytest

from flowkit.data.records import RecordError, load_records, strings_in

REQUIRED = ("prompt", "answer")


def write_lines(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def good(i: int) -> bytes:
    return json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}).encode()


def test_jsonl_loads_all_records_and_ignores_blank_lines(tmp_path):
    path = write_lines(tmp_path / "train.jsonl", [good(1), b"", b"   ", good(2)])
    records = load_records(path, REQUIRED)
    assert records == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+1=", "answer": "3"}]
    assert records.skipped == 0


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        (b'{"prompt": "1+1=", "answer": ', "malformed JSON"),
        (b'["1+1=", "2"]', "expected a JSON object, got list"),
        (b'{"prompt": "1+1="}', "missing required field 'answer'"),
        (b'{"prompt": "", "answer": "2"}', "required field 'prompt' is empty"),
        (b'{"prompt": " \\t\\n ", "answer": "2"}', "required field 'prompt' is empty"),
        (b'{"prompt": null, "answer": "2"}', "required field 'prompt' is empty"),
        (b'{"prompt": "1+1\xff=", "answer": "2"}', "not valid UTF-8"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, message):
    path = write_lines(tmp_path / "train.jsonl", [good(1), good(2), bad_line, good(3)])
    with pytest.raises(RecordError) as info:
        load_records(path, REQUIRED)
    text = str(info.value)
    assert text.startswith(f"{path}:3: ")
    assert message in text
    assert "\n" not in text


def test_skip_mode_drops_bad_lines_counts_them_and_warns_once(tmp_path, caplog):
    lines = [good(1), b"{oops", b'{"prompt": "x"}', b"\xc3\x28", b'{"prompt": " ", "answer": "1"}', good(2)]
    path = write_lines(tmp_path / "train.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="flowkit.data.records"):
        records = load_records(path, REQUIRED, on_error="skip")
    assert [r["answer"] for r in records] == ["2", "3"]
    assert records.skipped == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "skipped 4 bad record(s) of 6" in warnings[0].getMessage()
    assert f"{path}:2: malformed JSON" in warnings[0].getMessage()


def test_missing_path_lists_nearby_files(tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "val.jsonl").write_text("")
    with pytest.raises(RecordError) as info:
        load_records(tmp_path / "trian.jsonl", REQUIRED)
    text = str(info.value)
    assert "no such file or directory" in text
    assert f"nearby in {tmp_path}: train.jsonl, val.jsonl" in text


def test_missing_directory_lists_closest_existing_ancestor(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("")
    with pytest.raises(RecordError, match=f"nearby in {tmp_path / 'data'}: train.jsonl"):
        load_records(tmp_path / "data" / "missing" / "train.jsonl", REQUIRED)


def test_unsupported_suffix_and_plain_directory_are_record_errors(tmp_path):
    csv = tmp_path / "train.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(RecordError, match="unsupported format '.csv'"):
        load_records(csv, REQUIRED)
    with pytest.raises(RecordError, match="not a datasets.save_to_disk dataset"):
        load_records(tmp_path, REQUIRED)


def test_invalid_on_error_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="on_error"):
        load_records(write_lines(tmp_path / "a.jsonl", [good(1)]), REQUIRED, on_error="ignore")


def test_parquet_rows_load_and_bad_rows_name_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "  ", "3+1="], "answer": ["2", "3", "4"]}), path)
    with pytest.raises(RecordError, match=rf"^{path}: row 2: required field 'prompt' is empty$"):
        load_records(path, REQUIRED)
    records = load_records(path, REQUIRED, on_error="skip")
    assert [r["prompt"] for r in records] == ["1+1=", "3+1="]
    assert records.skipped == 1


def test_corrupt_parquet_is_a_record_error(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "train.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(RecordError, match=f"^{path}: cannot read parquet"):
        load_records(path, REQUIRED)


def test_saved_dataset_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"prompt": "1+1=", "answer": "2"}, {"prompt": "", "answer": "3"}]).save_to_disk(
        tmp_path / "ds"
    )
    records = load_records(tmp_path / "ds", REQUIRED, on_error="skip")
    assert records == [{"prompt": "1+1=", "answer": "2"}]
    assert records.skipped == 1


def test_saved_dataset_without_datasets_installed_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)
    with pytest.raises(RecordError, match="needs the 'datasets' package"):
        load_records(tmp_path / "ds", REQUIRED)


def test_json_nested_too_deeply_is_a_record_error_not_a_recursion_error(tmp_path):
    deep = b'{"prompt": "1+1=", "answer": "2", "meta": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    path = write_lines(tmp_path / "train.jsonl", [good(1), deep, good(2)])
    with pytest.raises(RecordError, match=rf"^{path}:2: JSON nested too deeply to parse \(more than about \d+ levels\)$"):
        load_records(path, REQUIRED)
    assert load_records(path, REQUIRED, on_error="skip").skipped == 1


def test_strings_are_found_at_any_depth_without_recursion():
    """A parsed record nests as deep as the parser went, close to the recursion limit: the walk must not recurse."""
    value = ["deep"]
    for _ in range(10 * sys.getrecursionlimit()):
        value = [{"k": value}]
    assert list(strings_in({"a": "x", "b": [1, "y", value]})) == ["x", "y", "deep"]


def test_a_line_longer_than_max_line_bytes_is_a_bad_record_and_the_next_line_still_loads(tmp_path):
    long = json.dumps({"prompt": "1+1=", "answer": "2", "solution": "x" * 5000}).encode()
    path = write_lines(tmp_path / "train.jsonl", [good(1), long, good(2)])
    with pytest.raises(RecordError, match=rf"^{path}:2: the line is longer than 1000 bytes, the most a record may take"):
        load_records(path, REQUIRED, max_line_bytes=1000)
    records = load_records(path, REQUIRED, on_error="skip", max_line_bytes=1000)
    assert records == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+1=", "answer": "3"}] and records.skipped == 1
    assert len(load_records(path, REQUIRED, max_line_bytes=len(long) + 1)) == 3  # the newline counts
