"""Several files in ``data.train``: each with its own format and sampling weight; a row index names one
(file, line) wherever it is shown; the caches key on what decides them (docs/config.md, "Several files")."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from soup_core.data import (
    DataError,
    build_training_list,
    epoch_order,
    file_draws,
    micro_batches,
    summarize,
    weighted_order,
)
from soup_core.default_plugins.formats import BUILTIN_FORMATS
from soup_core.testing import TrainingFailed, run_soup, write_jsonl

pytest_plugins = ["soup_core.testing"]

FORMATS = {f.name: f for f in BUILTIN_FORMATS}


def chats(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(n)]


def write_alpaca_csv(path: Path, n: int, poisoned: int | None = None) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["instruction", "output"])
        for i in range(n):
            answer = f"{i} times two is {2 * i}."
            if i == poisoned:  # a long answer of noise: its loss dwarfs every other row's in its step
                answer = "GARBAGE " + "".join("qzxjkvwy#@!%&*"[(i * 7 + k * 13) % 14] for k in range(500))
            writer.writerow([f"Double {i}.", answer])
    return path


@pytest.fixture
def two_files(tmp_path: Path) -> tuple[Path, Path]:
    return write_jsonl(tmp_path / "a.jsonl", chats(5)), write_alpaca_csv(tmp_path / "b.csv", 3)


# ------------------------------------------------------------------------------------------ the order


def test_a_weighted_epoch_draws_each_file_round_weight_times_rows():
    spans = [(3, 1.0), (4, 2.5), (5, 0.5)]  # rows 0-2, 3-6, 7-11
    assert [file_draws(n, w) for n, w in spans] == [3, 10, 3]  # floor(w*n + 0.5): 3, 10, floor(3.0)
    for epoch in range(4):
        counts = Counter(weighted_order(spans, epoch=epoch, seed=7))
        assert sum(counts.values()) == 16
        assert [counts[r] for r in range(3)] == [1, 1, 1]
        assert sorted(counts[r] for r in range(3, 7)) == [2, 2, 3, 3]  # 2 whole passes + 2 drawn rows
        assert sorted(counts[r] for r in range(7, 12)) == [0, 0, 1, 1, 1]  # 3 of 5 drawn, none twice
    drawn = {tuple(sorted(r for r in weighted_order(spans, epoch=e, seed=7) if r >= 7)) for e in range(6)}
    assert len(drawn) > 1  # the fraction is drawn afresh each epoch (seeded: the same run draws the same)
    assert weighted_order(spans, epoch=2, seed=7) == weighted_order(spans, epoch=2, seed=7)
    # every weight 1 is exactly the plain order (control: a weight of 2 is not)
    assert weighted_order([(3, 1), (4, 1)], epoch=1, seed=5) == epoch_order(7, epoch=1, seed=5)
    assert weighted_order([(3, 1), (4, 2)], epoch=1, seed=5) != epoch_order(7, epoch=1, seed=5)
    assert file_draws(10, 0.01) == 1 and file_draws(0, 3) == 0  # a file always gives at least one row


def test_micro_batches_cut_the_weighted_epoch_and_refuse_counts_that_do_not_add_up():
    batches = micro_batches(7, batch_size=4, epoch=0, seed=1, spans=[(3, 1), (4, 2)])
    assert [len(b) for b in batches] == [4, 4, 3] and Counter(sum(batches, [])) == Counter([0, 1, 2, *[3, 4, 5, 6] * 2])
    ranks = [micro_batches(7, batch_size=2, epoch=0, seed=1, rank=r, world_size=2, spans=[(3, 1), (4, 2)])
             for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 3  # 11 rows over 2 ranks x 2: padded to 12 by wrapping
    with pytest.raises(ValueError, match="add up to 7, not n_rows=8"):
        micro_batches(8, batch_size=2, epoch=0, seed=1, spans=[(3, 1), (4, 2)])


def test_max_steps_prepares_the_rows_the_weighted_order_reaches():
    from types import SimpleNamespace

    from soup_core.default_plugins.prepared import rows_used

    t = SimpleNamespace(max_steps=1, gradient_accumulation_steps=1, batch_size=2)
    config, spans = SimpleNamespace(training=t, data=SimpleNamespace(seed=3)), [(20, 1.0), (4, 5.0)]
    used = rows_used(config, 24, spans=spans)
    reached = micro_batches(24, batch_size=2, epoch=0, seed=3, spans=spans)[:4]  # (1 + 1) x 1 + 2 batches
    assert used == sorted(set(sum(reached, [])))
    assert rows_used(config, 24) != used  # control: the plain order reaches other rows


# ------------------------------------------------------------------------------------------ the list


def test_each_file_is_read_with_its_own_format_and_rows_keep_their_file_and_line(two_files):
    a, b = two_files
    data = {"train": [str(a), {"path": str(b), "weight": 2}], "val_split": 0.0}
    built = build_training_list(data, formats=FORMATS)
    assert [(f.path, f.format, f.weight, f.rows, f.detected) for f in built.files] == [
        (str(a), "chat", 1.0, 5, True), (str(b), "alpaca", 2.0, 3, True)]
    assert built.format == "chat, alpaca" and built.spans == [(5, 1.0), (3, 2.0)] and built.epoch_rows == 11
    assert built.origin(4) == (str(a), 5) and built.origin(5) == (str(b), 2) and built.origin(7) == (str(b), 4)
    assert built.origin(8) is None and built.rows[5]["prompt"].startswith("Double 0.")
    text = summarize(built)
    assert "11 rows drawn per epoch" in text and f"{b}: 3 training rows (format: alpaca, auto-detected), " \
        "weight 2 -> 6 per epoch" in text
    # control: one format for both files (the section's) fails on the second file's first row
    with pytest.raises(DataError) as info:
        build_training_list({**data, "format": "chat"}, formats=FORMATS)
    assert (info.value.path, info.value.line) == (str(b), 2)
    # an entry's own format wins over the section's
    both = build_training_list({"train": [str(a), {"path": str(b), "format": "alpaca"}], "format": "chat"},
                               formats=FORMATS)
    assert [f.format for f in both.files] == ["chat", "alpaca"] and both.spans is None  # weights 1: plain order


@pytest.mark.parametrize(("entry", "message"), [
    ({"path": "b.csv", "weight": -1}, "data.train[1].weight: must be > 0, got -1"),
    ({"path": "b.csv", "format": "nope"}, "data.train[1].format: unknown format 'nope'"),
    ({"path": "missing.csv"}, "missing.csv: not found"),
    ({"weight": 2}, "data.train[1].path: required"),
])
def test_a_bad_entry_is_named(two_files, entry, message):
    a, _ = two_files
    with pytest.raises(DataError) as info:
        build_training_list({"train": [str(a), entry]}, formats=FORMATS, base_dir=a.parent)
    assert message in str(info.value)


def test_the_rows_cache_keys_on_each_files_content_and_format_not_its_weight(two_files, soup_home):
    from soup_core.data.rows_cache import cached_training_list
    from soup_core.default_plugins.prepared import key_parts

    a, b = two_files

    def cached(entry: dict) -> object:
        return cached_training_list({"train": [str(a), entry]}, formats=FORMATS)

    first = cached({"path": str(b), "weight": 2})
    again = cached({"path": str(b), "weight": 3})  # the weight orders rows, it changes none
    assert again.rows.path == first.rows.path and again.files[1].weight == 3 and again.epoch_rows == 14
    assert list(again.origins) == list(build_training_list({"train": [str(a), str(b)]}, formats=FORMATS).origins)
    named = cached({"path": str(b), "weight": 2, "format": "alpaca"})  # same rows, but a different key
    assert named.rows.path != first.rows.path and list(named.rows) == list(first.rows)
    write_alpaca_csv(b, 4)  # the second file's content changed
    grown = cached({"path": str(b), "weight": 2})
    assert grown.rows.path != first.rows.path and grown.files[1].rows == 4 and grown.epoch_rows == 13

    class Config:  # the prepared-data key: the same with another weight, not with another format
        def __init__(self, entry: dict) -> None:
            self.data = type("D", (), {"model_dump": lambda _, mode: {"train": [str(a), entry], "seed": 1}})()

    class Task:
        name, encoding_version = "sft", 1

    tok = type("Tok", (), {"get_vocab": lambda _: {"a": 0}, "special_tokens_map": {}, "chat_template": None})()
    part = {"path": str(b), "weight": 2}

    def key(entry: dict) -> dict:
        return key_parts(Task(), first, tok, Config(entry))

    assert key({**part, "weight": 5}) == key(part) and key({**part, "format": "alpaca"}) != key(part)


# ------------------------------------------------------------------------------------------ end to end


def test_a_weighted_two_file_run_trains_by_weight_and_rewind_names_the_second_files_line(
        run_training, tmp_path, torch_one_thread):
    a = write_jsonl(tmp_path / "a.jsonl", chats(5))
    poisoned = 1  # b.csv's second data row: its line 3, training row 5 + 1
    b = write_alpaca_csv(tmp_path / "b.csv", 3, poisoned=poisoned)
    config = {"data": {"train": [str(a), {"path": str(b), "weight": 2}], "max_length": 256},
              "training": {"epochs": 2, "batch_size": 2, "learning_rate": 0.01, "lora": {"r": 0}, "save_steps": 6}}
    planned = run_training(config, dry_run=True)
    assert "11 rows drawn per epoch" in planned.output and "weight 2 -> 6 per epoch" in planned.output

    run = run_training(config)
    assert run.status == "completed" and len(run.steps) == 2 * 6  # ceil(11 / 2) steps per epoch
    expected = Counter({**dict.fromkeys(range(5), 1), **dict.fromkeys(range(5, 8), 2)})
    for epoch in range(2):
        seen = Counter(r for m in run.micro if (m.step - 1) // 6 == epoch for r in m.rows)
        assert seen == expected, epoch
        assert seen != Counter(range(8))  # control: the unweighted epoch, each row once, is a different count

    bad = 5 + poisoned
    step = next(m.step for m in run.micro if bad in m.rows)
    shown = run_soup(["rewind", run.run_id, "--step", str(step), "--json", "r.json"], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    top = json.loads((tmp_path / "r.json").read_text())["rows"][0]
    assert (top["row"], top["file"], top["line"]) == (bad, str(b), poisoned + 2)
    assert f"row {bad}: " in shown.stdout and f"from {b} line {poisoned + 2}" in shown.stdout
    dropped = run_soup(["rewind", run.run_id, "--drop-rows", str(bad), "--write-data", "kept.jsonl"], cwd=tmp_path)
    assert dropped.returncode == 1 and f"row {bad}: {b} line {poisoned + 2}" in dropped.stderr, dropped.stderr
    assert not (tmp_path / "kept.jsonl").exists()  # one file of chat and alpaca rows would read as neither

    # resuming continues the checkpoint's order: another weight is refused (control: the same files are not)
    resume = {**config, "output": str(run.output_dir)}
    resume["training"] = {**config["training"], "resume_from": str(run.output_dir / "checkpoint-6")}
    assert run_training(resume, dry_run=True).status == "planned"
    reweighted = {**resume, "data": {**config["data"], "train": [str(a), {"path": str(b), "weight": 3}]}}
    with pytest.raises(TrainingFailed) as refused:
        run_training(reweighted, dry_run=True)
    assert "was trained on data.train" in str(refused.value) and "row order" in str(refused.value)


def test_a_weight_the_backend_does_not_draw_by_is_refused(two_files):
    a, b = two_files
    for backend_task, reason in ((("mlx", "sft"), "the mlx trainer draws every row once per epoch"),
                                 (("transformers", "dpo"), "not honoured by backend 'transformers' with task 'dpo'")):
        config = a.parent / "soup.yaml"
        config.write_text(f"base: x\nbackend: {backend_task[0]}\ntask: {backend_task[1]}\ndata:\n"
                          f"  train: [{a}, {{path: {b}, weight: 2}}]\n", encoding="utf-8")
        result = run_soup(["train", "-c", str(config), "--dry-run"])
        assert result.returncode == 1 and "data.train[1].weight: " in result.stderr and reason in result.stderr
        assert "Traceback" not in result.stderr
    config.write_text(f"base: x\noutput: {a.parent / 'out'}\ndata:\n  train: [{a}, {{path: {b}, weight: 0}}]\n",
                      encoding="utf-8")
    result = run_soup(["train", "-c", str(config)])
    assert result.returncode == 1 and "data.train[1].weight: must be > 0, got 0" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (a.parent / "out").exists()
