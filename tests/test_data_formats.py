"""The built-in formats, auto-detection, bad rows and the task's accepted formats."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from soup_core.data import DataError, build_training_list, summarize
from soup_core.default_plugins.formats import BUILTIN_FORMATS, alpaca_prompt

FORMATS = {f.name: f for f in BUILTIN_FORMATS}


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


def chat(q: str, a: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [user(q), assistant(a)], **extra}


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def data(train: Any, **kwargs: Any) -> SimpleNamespace:
    fields = {"train": train, "format": "auto", "val_split": 0.0, "seed": 42, "on_bad_row": "error"}
    fields.update(kwargs)
    return SimpleNamespace(**fields)


def build(path: Path, **kwargs: Any) -> Any:
    accepted = kwargs.pop("accepted", None)
    return build_training_list(data(str(path), **kwargs), formats=FORMATS, accepted=accepted)


def build_error(path: Path, **kwargs: Any) -> DataError:
    with pytest.raises(DataError) as info:
        build(path, **kwargs)
    return info.value


# ---------------------------------------------------------------------------------------- the formats


def test_chat_normalises_and_drops_extra_keys(tmp_path: Path) -> None:
    record = {
        "id": 7,
        "messages": [{"role": "system", "content": "be brief", "name": "x"}, user("q"), assistant("a")],
    }
    result = build(write_jsonl(tmp_path / "d.jsonl", [record]))
    assert result.rows == [{"messages": [{"role": "system", "content": "be brief"}, user("q"), assistant("a")]}]
    assert (result.format, result.detected) == ("chat", True)


def test_alpaca_with_and_without_input(tmp_path: Path) -> None:
    records = [
        {"instruction": "Add", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"instruction": "Say yo", "output": "yo"},
    ]
    result = build(write_jsonl(tmp_path / "d.jsonl", records))
    assert result.format == "alpaca"
    assert result.rows == [
        {"prompt": "Add\n\nInput:\n2 and 3\n\nResponse:\n", "completion": "5"},
        {"prompt": "Say hi\n\nResponse:\n", "completion": "hi"},
        {"prompt": "Say yo\n\nResponse:\n", "completion": "yo"},
    ]
    assert alpaca_prompt("Add", "2 and 3") == "Add\n\nInput:\n2 and 3\n\nResponse:\n"


def test_prompt_completion_and_text(tmp_path: Path) -> None:
    pc = build(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "", "completion": "c", "meta": 1}]))
    assert (pc.format, pc.rows) == ("prompt_completion", [{"prompt": "", "completion": "c"}])
    text = build(write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}]))
    assert (text.format, text.rows) == ("text", [{"text": "hello"}])


def test_auto_detection_priority(tmp_path: Path) -> None:
    # A record carrying every format's keys is chat; without messages, alpaca; and so on.
    full = {
        **chat("q", "a"),
        "instruction": "i",
        "output": "o",
        "prompt": "p",
        "completion": "c",
        "text": "t",
    }
    expected = ["chat", "alpaca", "prompt_completion", "text"]
    for i, name in enumerate(expected):
        record = dict(full)
        for dropped in (["messages"], ["instruction"], ["prompt"])[:i]:
            for key in dropped:
                record.pop(key)
        assert build(write_jsonl(tmp_path / f"{i}.jsonl", [record])).format == name


def test_explicit_format_is_not_detected(tmp_path: Path) -> None:
    result = build(write_jsonl(tmp_path / "d.jsonl", [{"text": "t", "prompt": "p", "completion": "c"}]), format="text")
    assert (result.format, result.detected, result.rows) == ("text", False, [{"text": "t"}])
    # the keys the text format does not read are said, not dropped silently
    assert summarize(result) == ("1 training row, 0 validation rows (format: text); left out, read by no format or "
                                 "task of this run (a task reads them with extra_keys): 'completion' (1 row), "
                                 "'prompt' (1 row)")


def test_auto_detect_skips_unrecognisable_first_records(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('not json\n{"foo": 1}\n' + json.dumps(chat("q", "a")) + "\n")
    result = build(path, on_bad_row="skip")
    assert result.format == "chat" and result.n_rows == 1
    assert [e.line for e in result.skipped] == [1, 2]
    assert result.skipped[0].message.startswith("not valid JSON")
    assert result.skipped[1].message.startswith("missing key 'messages' (format chat needs 'messages')")


def test_auto_detect_failure_lists_formats_and_keys(tmp_path: Path) -> None:
    err = build_error(write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}] * 3))
    text = str(err)
    assert err.line == 1 and "cannot detect the data format" in text
    assert "answer, question" in text
    for part in (
        "chat (messages)",
        "alpaca (instruction, output)",
        "prompt_completion (prompt, completion)",
        "text (text)",
    ):
        assert part in text


def test_auto_detect_only_considers_accepted_formats(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "t", "prompt": "p", "completion": "c"}])
    assert build(path).format == "prompt_completion"
    assert build(path, accepted=["chat", "text"]).format == "text"


def test_explicit_format_outside_accepted_is_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "t"}])
    err = build_error(path, format="text", accepted=["chat", "alpaca"])
    assert "does not accept format 'text'" in str(err) and "chat, alpaca" in str(err)


def test_unknown_format_lists_registered_ones(tmp_path: Path) -> None:
    err = build_error(write_jsonl(tmp_path / "d.jsonl", [{"text": "t"}]), format="sharegpt")
    assert "unknown format 'sharegpt'" in str(err)
    assert "alpaca, chat, prompt_completion, text" in str(err)


# ------------------------------------------------------------------------------------------- bad rows


BAD_CHAT = [
    ({"messages": "hello"}, "'messages' must be a list of {role, content} objects, got str"),
    ({"messages": []}, "'messages' is empty"),
    ({"messages": [user("q")]}, "no assistant message"),
    ({"messages": [assistant("a"), user("q")]}, "opens with an assistant message"),
    ({"messages": [user("q"), {"role": "bot", "content": "a"}]}, "messages[1].role must be one of"),
    (
        {"messages": [user("q"), {"role": "assistant", "content": 3}]},
        "messages[1].content must be a string, got int",
    ),
    ({"messages": [user("q"), {"role": "assistant"}]}, "messages[1] has no 'content'"),
    (
        {"messages": [user("q"), assistant("a"), {"role": "system", "content": "s"}]},
        "system message may only",
    ),
    ({"messages": [user("q"), assistant("  ")]}, "every assistant message is empty"),
    ({"messages": ["q"]}, "messages[0] must be a {role, content} object, got str"),
]


@pytest.mark.parametrize(("record", "message"), BAD_CHAT)
def test_bad_chat_rows_name_file_line_and_problem(tmp_path: Path, record: dict, message: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [chat("q", "a"), chat("q2", "a2"), record])
    err = build_error(path)
    assert (err.path, err.line) == (str(path), 3)
    assert str(err).startswith(f"{path} line 3: ") and message in str(err)
    assert "on_bad_row: skip" in err.fix


def test_chat_allows_system_then_assistant(tmp_path: Path) -> None:
    record = {"messages": [{"role": "system", "content": "s"}, assistant("greeting"), user("q"), assistant("a")]}
    assert build(write_jsonl(tmp_path / "d.jsonl", [record])).n_rows == 1


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"instruction": "i", "output": 5}, "'output' must be a string, got int"),
        ({"instruction": "", "output": "o"}, "'instruction' is empty"),
        ({"instruction": "i", "input": ["x"], "output": "o"}, "'input' must be a string, got list"),
        ({"instruction": "i"}, "missing key 'output'"),
    ],
)
def test_bad_alpaca_rows(tmp_path: Path, record: dict, message: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "i", "output": "o"}, record])
    err = build_error(path, format="alpaca")
    assert err.line == 2 and message in str(err)


def test_missing_key_under_explicit_format(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "completion": "c"}, {"prompt": "p"}])
    err = build_error(path, format="prompt_completion")
    assert str(err).startswith(f"{path} line 2: missing key 'completion'")


def test_skip_mode_counts_and_keeps_every_error(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    lines = [
        json.dumps(chat("q0", "a0")),
        "{broken",
        json.dumps({"messages": [user("q")]}),
        json.dumps(chat("q3", "a3")),
        "[]",
        json.dumps(chat("q5", "a5")),
    ]
    path.write_text("\n".join(lines) + "\n")
    result = build(path, on_bad_row="skip")
    assert result.n_rows == 3
    assert [e.line for e in result.skipped] == [2, 3, 5]
    assert result.origins == [(str(path), 1), (str(path), 4), (str(path), 6)]
    assert summarize(result) == "3 training rows, 0 validation rows (format: chat, auto-detected); 3 bad rows skipped"
    # Control: the same file under on_bad_row=error stops at the first bad line.
    assert build_error(path).line == 2


def test_all_rows_bad_is_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [user("q")]}] * 2)
    err = build_error(path, on_bad_row="skip")
    assert "no usable rows: all 2 rows are bad" in str(err)


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n\n")
    assert "no rows" in str(build_error(path))
    assert "no rows" in str(build_error(path, format="text"))


def test_csv_rows_through_the_pipeline_keep_file_lines(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["instruction", "input", "output"])
        writer.writerow(["Two\nlines", "", "ok"])
        writer.writerow(["Fine", "", ""])
    err = build_error(path)
    assert str(err) == f"{path} line 4: 'output' is empty"
    assert build(path, on_bad_row="skip").rows == [{"prompt": "Two\nlines\n\nResponse:\n", "completion": "ok"}]


def test_json_record_numbers_in_errors(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"data": [{"text": "a"}, {"text": ""}]}))
    assert str(build_error(path)) == f"{path} record 2: 'text' is empty"


def test_parquet_and_save_to_disk_through_the_pipeline(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    records = [chat(f"q{i}", f"a{i}", id=i) for i in range(4)]
    records[2]["messages"][1]["content"] = ""
    ds = datasets.Dataset.from_list(records)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for source in (tmp_path / "d.parquet", tmp_path / "saved"):
        err = build_error(source)
        assert (err.line, err.unit) == (3, "record") and "record 3: every assistant message is empty" in str(err)
        result = build(source, on_bad_row="skip")
        assert result.rows == [{"messages": r["messages"]} for i, r in enumerate(records) if i != 2]


def test_relative_path_resolves_against_base_dir(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "d.jsonl", [{"text": "a"}])
    result = build_training_list(data("data/d.jsonl"), formats=FORMATS, base_dir=tmp_path)
    assert result.rows == [{"text": "a"}] and result.source == str(tmp_path / "data" / "d.jsonl")
    with pytest.raises(DataError) as info:
        build_training_list(data("data/d.jsonl"), formats=FORMATS, base_dir=tmp_path / "elsewhere")
    assert info.value.path == "data/d.jsonl" and "not found" in str(info.value)


def test_other_data_key_and_unset_key(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "f.jsonl", [{"text": "forget me"}])
    section = SimpleNamespace(train=None, forget=str(path), format="auto", val_split=0.0, seed=0, on_bad_row="error")
    assert build_training_list(section, formats=FORMATS, key="forget").rows == [{"text": "forget me"}]
    with pytest.raises(DataError, match="data.train is not set"):
        build_training_list(section, formats=FORMATS)


def test_plugin_module_registers_the_builtin_formats() -> None:
    import pluggy

    from soup_core import hookspecs
    from soup_core.default_plugins import formats as plugin

    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.register(plugin, name="core.formats")
    registered = [f.name for group in manager.hook.soup_register_data_formats() for f in group]
    assert registered == ["chat", "alpaca", "prompt_completion", "text"]
    assert plugin.SOUP_HOOK_API == (1, 1)
