"""Prepared data written by the fast path (several encoding processes taking chunks in turn, Arrow columns built
from numpy buffers) holds, row for row, the tokens and labels of the per-row definition
(:func:`soup_core.default_plugins.sft.encode_example`), also once a packing collator has joined them."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from soup_core.testing import write_jsonl

pytest_plugins = ["soup_core.testing"]

MAX_LENGTH = 40


def _rows() -> list[dict]:
    rows = []
    for i in range(60):
        kind = i % 5
        if kind == 0:  # multi-turn with a system prompt
            rows.append({"messages": [{"role": "system", "content": f"be brief {i}"},
                                      {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"},
                                      {"role": "user", "content": "more"}, {"role": "assistant", "content": f"b{i}"}]})
        elif kind == 1:  # long: cut at max_length, inside the answer
            rows.append({"messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "long answer " * (3 + i)}]})
        elif kind == 2:  # non-ASCII text, an answer past max_length
            rows.append({"messages": [{"role": "user", "content": "東京 🎉 " * (1 + i % 3)},
                                      {"role": "assistant", "content": f"ok {i} " * 12}]})
        elif kind == 3:
            rows.append({"prompt": f"prompt {i} " * (1 + i % 4), "completion": f"done {i}"})
        else:
            rows.append({"text": f"plain text row {i} " * (1 + i % 6)})
    return rows


class _Data(SimpleNamespace):
    def model_dump(self, mode: str = "json") -> dict:
        return dict(vars(self))


FILES = ["chat.jsonl", "pc.jsonl", "text.jsonl"]  # a file holds one format


def _config(max_length: int = MAX_LENGTH) -> SimpleNamespace:
    return SimpleNamespace(data=_Data(train=FILES, max_length=max_length, train_on_responses_only=True,
                                      packing=False, on_bad_row="error", val_split=0.0, seed=0, format="auto"))


@pytest.fixture()
def prepared_rows(tmp_path, soup_home, tiny_model, monkeypatch):
    from transformers import AutoTokenizer

    from soup_core.data import build_training_list
    from soup_core.default_plugins import prepared
    from soup_core.default_plugins.formats import BUILTIN_FORMATS
    from soup_core.default_plugins.sft import SFTTask

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: encoding stays in one process")
    monkeypatch.setattr(prepared, "CHUNK", 8)  # parts of two rows, over 2+ processes
    rows = _rows()
    write_jsonl(tmp_path / "chat.jsonl", [r for r in rows if "messages" in r])
    write_jsonl(tmp_path / "pc.jsonl", [r for r in rows if "prompt" in r])
    write_jsonl(tmp_path / "text.jsonl", [r for r in rows if "text" in r])
    training = build_training_list(_config().data, formats={f.name: f for f in BUILTIN_FORMATS}, base_dir=tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    got = prepared.prepare_encoded(SFTTask(), training, tokenizer, _config())
    assert got.meta["train"]["workers"] >= 2  # control: the several-process path ran
    return SimpleNamespace(rows=got.train.to_list(), training=training, tokenizer=tokenizer)


def _slow(s, max_length: int = MAX_LENGTH) -> list[tuple[list[int], list[int]]]:
    from soup_core.default_plugins.sft import encode_example

    return [encode_example(row, s.tokenizer, max_length=max_length) for row in s.training.rows]


def test_prepared_rows_are_the_per_row_encoding(prepared_rows):
    slow = _slow(prepared_rows)
    got = [(r["input_ids"], r["labels"]) for r in prepared_rows.rows]
    assert [r["row_index"] for r in prepared_rows.rows] == list(range(len(slow)))
    assert got == slow
    assert sum(len(ids) == MAX_LENGTH for ids, _ in slow) >= 6  # rows were cut at max_length
    assert any(-100 in labels and set(labels) != {-100} for _, labels in slow)  # masks, not all-trained rows
    # control: one more token of room changes the long rows, and the comparison sees it
    assert got != _slow(prepared_rows, MAX_LENGTH + 1)


def test_a_packed_batch_of_prepared_rows_is_the_per_row_one(prepared_rows):
    import torch

    from soup_core.default_plugins.transformers.trainer import RowCollator

    collate = RowCollator(pad_token_id=0, packing=True)
    slow = [{"input_ids": ids, "labels": labels, "row_index": i}
            for i, (ids, labels) in enumerate(_slow(prepared_rows))]
    fast, want = collate(prepared_rows.rows[32:44]), collate(slow[32:44])  # chat and prompt/completion rows
    for key in ("input_ids", "labels", "row_index", "token_slot"):
        assert torch.equal(fast[key], want[key]), key
    assert not torch.equal(fast["labels"], collate(slow[33:45])["labels"])  # control: other rows differ
