"""The training list: validation split, fingerprint, rendering, and import lightness."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from soup_core.data import (
    TrainingList,
    build_training_list,
    fingerprint_rows,
    row_text,
    split_indices,
    summarize,
)
from soup_core.default_plugins.formats import BUILTIN_FORMATS

FORMATS = {f.name: f for f in BUILTIN_FORMATS}
ROOT = Path(__file__).resolve().parents[1]


def texts(n: int, path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(n)), encoding="utf-8")
    return path


def build(path: Path, **kwargs: Any) -> TrainingList:
    fields = {"train": str(path), "format": "auto", "val_split": 0.0, "seed": 42, "on_bad_row": "error"}
    fields.update(kwargs)
    return build_training_list(SimpleNamespace(**fields), formats=FORMATS)


# ---------------------------------------------------------------------------------------------- split


def test_val_split_is_deterministic_and_keeps_file_order(tmp_path: Path) -> None:
    path = texts(100, tmp_path / "d.jsonl")
    first = build(path, val_split=0.1, seed=7)
    again = build(path, val_split=0.1, seed=7)
    other = build(path, val_split=0.1, seed=8)
    assert (first.n_rows, first.n_val) == (90, 10)
    assert first.rows == again.rows and first.val_rows == again.val_rows
    assert first.fingerprint == again.fingerprint
    assert first.val_rows != other.val_rows and first.fingerprint != other.fingerprint  # control
    numbers = [int(r["text"].split()[1]) for r in first.rows]
    assert numbers == sorted(numbers)  # training rows keep their relative order
    held = {int(r["text"].split()[1]) for r in first.val_rows}
    assert held.isdisjoint(numbers) and len(held) + len(numbers) == 100
    assert first.origins == [(str(path), n + 1) for n in numbers]  # line n+1 holds row n


def test_split_sizes() -> None:
    assert split_indices(10, 0.0, 1) == []
    assert split_indices(1, 0.5, 1) == []  # the training set is never emptied
    assert len(split_indices(2, 0.01, 1)) == 1  # at least one validation row
    assert len(split_indices(267, 0.1, 1)) == 27  # 26.7 rounds to 27
    assert len(split_indices(10, 0.25, 1)) == 3  # 2.5 rounds half up
    # Pinned: the split must not change across Python versions (checked on 3.10 to 3.13).
    assert split_indices(20, 0.25, 42) == [0, 3, 7, 8, 16]


def test_val_split_out_of_range_is_a_data_error(tmp_path: Path) -> None:
    from soup_core.data import DataError

    with pytest.raises(DataError, match="val_split"):
        build(texts(3, tmp_path / "d.jsonl"), val_split=1.5)


def test_summary_with_validation_rows(tmp_path: Path) -> None:
    result = build(texts(267, tmp_path / "d.jsonl"), val_split=0.1)
    assert summarize(result) == "240 training rows, 27 validation rows (format: text, auto-detected)"


# ---------------------------------------------------------------------------------------- fingerprint


def test_fingerprint_closed_form() -> None:
    rows = [{"b": 1, "a": "é"}, {"text": "x"}]
    expected = hashlib.sha256('{"a":"é","b":1}\n{"text":"x"}\n'.encode()).hexdigest()
    assert fingerprint_rows(rows) == expected
    assert fingerprint_rows([]) == hashlib.sha256(b"").hexdigest()


def test_fingerprint_ignores_key_order_and_formatting_but_not_content_or_order(tmp_path: Path) -> None:
    rows = [{"prompt": "p", "completion": "c"}, {"prompt": "q", "completion": "d"}]
    base = fingerprint_rows(rows)
    assert fingerprint_rows([{"completion": "c", "prompt": "p"}, rows[1]]) == base
    assert fingerprint_rows([{"prompt": "p", "completion": "C"}, rows[1]]) != base  # one character
    assert fingerprint_rows(list(reversed(rows))) != base  # order
    # Same data, differently formatted file: same fingerprint; one changed character: different.
    a = tmp_path / "a.jsonl"
    a.write_text('{"text": "hello"}\n{"text": "world"}\n')
    b = tmp_path / "b.jsonl"
    b.write_text('{ "text":"hello" }\n\n{"text":   "world", "id": 3}\n')
    c = tmp_path / "c.jsonl"
    c.write_text('{"text": "hello"}\n{"text": "worle"}\n')
    assert build(a).fingerprint == build(b).fingerprint == fingerprint_rows(build(a).rows)
    assert build(c).fingerprint != build(a).fingerprint


def test_fingerprint_covers_training_rows_only(tmp_path: Path) -> None:
    result = build(texts(30, tmp_path / "d.jsonl"), val_split=0.2)
    assert result.fingerprint == fingerprint_rows(result.rows)
    assert result.fingerprint != fingerprint_rows(result.rows + result.val_rows)


# ------------------------------------------------------------------------------------------ rendering


def test_row_text() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert row_text(chat) == "user: hi\nassistant: hello"
    assert row_text({"prompt": "p", "completion": "c"}) == "prompt: p\ncompletion: c"
    assert row_text({"text": "plain"}) == "plain"
    assert row_text({"prompt": "p", "chosen": [1]}) == "prompt: p\nchosen: [1]"


def test_summary_singular_and_skipped() -> None:
    from soup_core.data import DataError

    one = TrainingList(
        rows=[{"text": "a"}],
        val_rows=[],
        fingerprint="",
        format="text",
        source="x",
        skipped=[DataError("x", 2, "bad")],
    )
    assert summarize(one) == "1 training row, 0 validation rows (format: text); 1 bad row skipped"
    assert one.n_rows == 1


# -------------------------------------------------------------------------------------------- imports


def test_import_is_light() -> None:
    code = (
        "import sys, soup_core.data, soup_core.default_plugins.formats\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'pyarrow', 'numpy', 'pandas') "
        "if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == ""
    # Control: the same check sees a heavy import when there is one.
    out = subprocess.run(
        [sys.executable, "-c", "import pyarrow\n" + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert "pyarrow" in out.stdout


def test_several_paths_are_concatenated_in_order(tmp_path: Path) -> None:
    a = texts(2, tmp_path / "a.jsonl")
    b = tmp_path / "b.jsonl"
    b.write_text('{"text": "b0"}\n', encoding="utf-8")
    result = build_training_list(SimpleNamespace(train=[str(a), str(b)]), formats=FORMATS)
    assert [r["text"] for r in result.rows] == ["row 0", "row 1", "b0"]
    assert result.origins == [(str(a), 1), (str(a), 2), (str(b), 1)]


def test_data_error_survives_pickling() -> None:
    import pickle

    from soup_core.data import DataError

    err = pickle.loads(pickle.dumps(DataError("d.json", 3, "bad", unit="record", fix="do x")))
    assert (str(err), err.line, err.unit, err.fix) == ("d.json record 3: bad", 3, "record", "do x")
