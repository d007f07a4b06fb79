"""Reading raw records: .jsonl, .json, .csv, .parquet, save_to_disk folders, and their error positions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from soup_core.data import DataError, read_records

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _error(path: Path) -> DataError:
    with pytest.raises(DataError) as info:
        list(read_records(path))
    return info.value


# ------------------------------------------------------------------------------------------------ jsonl


def test_jsonl_numbers_are_file_lines_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"text": "a"}), "", "   ", json.dumps({"text": "b"})])
    assert list(read_records(path)) == [(1, {"text": "a"}), (4, {"text": "b"})]


def test_jsonl_with_bom_and_crlf(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n{"text": "b"}\r\n')
    assert [r for _, r in read_records(path)] == [{"text": "a"}, {"text": "b"}]


def test_jsonl_bad_json_names_file_and_line(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"text": "a"}), "{not json", json.dumps({"text": "b"})])
    err = _error(path)
    assert (err.path, err.line, err.unit) == (str(path), 2, "line")
    assert str(err).startswith(f"{path} line 2: not valid JSON")


def test_jsonl_line_that_is_not_an_object(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"text": "a"}), "[1, 2]"])
    err = _error(path)
    assert err.line == 2 and "expected a JSON object, got list" in str(err)


def test_jsonl_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    err = _error(path)
    assert err.line == 2 and "not UTF-8" in err.message


# ------------------------------------------------------------------------------------------------- json


def test_json_list_numbers_records(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=2))
    assert list(read_records(path)) == [(1, {"text": "a"}), (2, {"text": "b"})]


def test_json_object_holding_one_list(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"version": "1", "data": [{"text": "a"}, {"text": "b"}]}))
    assert [r for _, r in read_records(path)] == [{"text": "a"}, {"text": "b"}]


def test_json_single_chat_object_is_one_record_not_a_container(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps(CHAT))
    assert list(read_records(path)) == [(1, CHAT)]


def test_json_non_object_record_says_record(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "a"}, "oops"]))
    err = _error(path)
    assert (err.line, err.unit) == (2, "record")
    assert str(err) == f"{path} record 2: expected a JSON object, got str"


def test_json_syntax_error_gives_the_line(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text('[\n  {"text": "a"},\n  {"text": }\n]\n')
    err = _error(path)
    assert err.line == 3 and "not valid JSON" in err.message


def test_json_file_holding_json_lines_is_read_as_json_lines(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.json", [json.dumps({"text": "a"}), json.dumps({"text": "b"})])
    assert list(read_records(path)) == [(1, {"text": "a"}), (2, {"text": "b"})]


def test_json_scalar_document_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text("42")
    assert "expected a list of records" in str(_error(path))


# -------------------------------------------------------------------------------------------------- csv


def test_csv_line_numbers_are_file_lines_including_multiline_cells(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text('prompt,completion\n"a\nb",c\n\nd,e\n', encoding="utf-8")
    assert list(read_records(path)) == [
        (2, {"prompt": "a\nb", "completion": "c"}),
        (5, {"prompt": "d", "completion": "e"}),
    ]


def test_csv_wrong_field_count_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("prompt,completion\na,b\nc,d,e\n", encoding="utf-8")
    err = _error(path)
    assert str(err) == f"{path} line 3: has 3 fields, the header has 2"


def test_csv_duplicate_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("text,text\na,b\n", encoding="utf-8")
    assert "repeats column" in str(_error(path))


def test_csv_long_cell_is_read(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    long = "x" * 300_000  # above the csv module's default 128 KiB field limit
    path.write_text(f"text\n{long}\n", encoding="utf-8")
    assert list(read_records(path)) == [(2, {"text": long})]


# ---------------------------------------------------------------------------------------- whole-file


def test_missing_file(tmp_path: Path) -> None:
    err = _error(tmp_path / "nope.jsonl")
    assert err.line is None and "not found" in str(err)


def test_unsupported_extension(tmp_path: Path) -> None:
    path = tmp_path / "d.txt"
    path.write_text("hello\n")
    err = _error(path)
    assert "unsupported file type (.txt)" in str(err) and ".jsonl" in str(err)


def test_plain_folder_is_refused(tmp_path: Path) -> None:
    assert "save_to_disk" in str(_error(tmp_path))


def test_missing_pyarrow_names_the_library_and_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    err = _error(path)
    assert "pyarrow" in str(err) and 'pip install "soup-core[train]"' in str(err)


def test_missing_datasets_names_the_library_and_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "state.json").write_text("{}")
    (tmp_path / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)
    err = _error(tmp_path)
    assert "needs datasets" in str(err) and 'pip install "soup-core[train]"' in str(err)


# ------------------------------------------------------------------------ parquet / save_to_disk (real)


ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}], "id": i}
    for i in range(5)
]


def test_parquet_written_by_datasets(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    assert list(read_records(path)) == list(enumerate(ROWS, 1))


def test_corrupt_parquet(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    path = tmp_path / "d.parquet"
    path.write_bytes(b"not parquet at all")
    assert "not a readable parquet file" in str(_error(path))


def test_save_to_disk_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    assert list(read_records(folder)) == list(enumerate(ROWS, 1))


def test_save_to_disk_dataset_dict_uses_train_split(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    splits = {"train": datasets.Dataset.from_list(ROWS[:3]), "test": datasets.Dataset.from_list(ROWS[3:])}
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    assert [r for _, r in read_records(folder)] == ROWS[:3]


def test_save_to_disk_dataset_dict_without_train_split_is_refused(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    splits = {"a": datasets.Dataset.from_list(ROWS[:3]), "b": datasets.Dataset.from_list(ROWS[3:])}
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    err = _error(folder)
    assert "several splits (a, b)" in str(err)


def test_json_lines_written_by_datasets_to_json(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "d.json"
    datasets.Dataset.from_list(ROWS).to_json(str(path))  # JSON Lines under a .json name
    assert [r for _, r in read_records(path)] == ROWS
