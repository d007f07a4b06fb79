"""The cache of prepared data: keyed by everything that decides it (each component, changed, rebuilds), filled
whole once by concurrent fillers, bounded, listed and cleared by `soup cache`; the dry run fills it and
`soup train` reads it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from soup_core.testing import run_soup, write_jsonl, write_yaml

pytest_plugins = ["soup_core.testing"]

ROWS = [{"messages": [{"role": "user", "content": f"question {i} " * (1 + i % 4)},
                      {"role": "assistant", "content": f"answer {i}"}]} for i in range(40)]


class _Data(SimpleNamespace):
    def model_dump(self, mode: str = "json") -> dict:
        return dict(vars(self))


def _config(**data) -> SimpleNamespace:
    base = dict(train="train.jsonl", max_length=64, train_on_responses_only=True, packing=False,
                on_bad_row="error", val_split=0.1, seed=0, format="auto")
    return SimpleNamespace(data=_Data(**{**base, **data}))


@pytest.fixture()
def setup(tmp_path, soup_home, tiny_model):
    from transformers import AutoTokenizer

    from soup_core.data import build_training_list
    from soup_core.default_plugins.formats import BUILTIN_FORMATS
    from soup_core.default_plugins.sft import SFTTask

    formats = {f.name: f for f in BUILTIN_FORMATS}

    def training(rows=ROWS):
        write_jsonl(tmp_path / "train.jsonl", rows)
        return build_training_list(_config().data, formats=formats, base_dir=tmp_path)

    return SimpleNamespace(task=SFTTask(), training=training, tokenizer=AutoTokenizer.from_pretrained(tiny_model),
                           tmp=tmp_path)


def _prepare(s, *, task=None, training=None, tokenizer=None, config=None):
    from soup_core.default_plugins.prepared import prepare_encoded

    return prepare_encoded(task or s.task, training or s.training(), tokenizer or s.tokenizer, config or _config())


def test_prepared_rows_are_the_task_encoding_memory_mapped(setup):
    from soup_core.default_plugins.sft import encode_rows

    training = setup.training()
    first = _prepare(setup, training=training)
    again = _prepare(setup, training=training)
    assert first.filled and not again.filled and again.folder == first.folder  # control: same key, no rebuild
    expected = encode_rows(training.rows, setup.tokenizer, max_length=64)
    got = again.train.to_list()
    assert [(e["input_ids"], e["labels"], e["row_index"]) for e in got] == [
        (e["input_ids"], e["labels"], e["row_index"]) for e in expected]
    assert again.val.num_rows == training.n_val == 4
    assert again.train.cache_files and again.train.cache_files[0]["filename"].startswith(str(again.folder))


def _with_new_token(tokenizer, folder: Path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(str(folder))
    changed = AutoTokenizer.from_pretrained(str(folder))
    changed.add_tokens(["question"])  # the tokenizer files change: "question" is one token now
    changed.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("component", ["data file", "tokenizer files", "chat template", "max length", "packing",
                                       "encoding version", "soup version"])
def test_changing_a_key_component_rebuilds(setup, component, monkeypatch):
    import copy

    import soup_core

    first = _prepare(setup)
    assert first.filled and not _prepare(setup).filled
    if component == "data file":
        again = _prepare(setup, training=setup.training([*ROWS[:-1], {"messages": [
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "changed"}]}]))
    elif component == "tokenizer files":
        again = _prepare(setup, tokenizer=_with_new_token(setup.tokenizer, setup.tmp / "tok"))
    elif component == "chat template":
        other = copy.deepcopy(setup.tokenizer)
        other.chat_template = setup.tokenizer.chat_template.replace("<|end|>", "<|end|> ")
        again = _prepare(setup, tokenizer=other)
    elif component == "max length":
        again = _prepare(setup, config=_config(max_length=32))
    elif component == "packing":
        again = _prepare(setup, config=_config(packing=True))
    elif component == "encoding version":
        task = type("SFTTask", (type(setup.task),), {"encode": type(setup.task).encode, "encoding_version": 2,
                                                      "__module__": type(setup.task).__module__})()
        again = _prepare(setup, task=task)
    else:
        monkeypatch.setattr(soup_core, "__version__", soup_core.__version__ + ".post1")
        again = _prepare(setup)
    assert again.filled and again.folder != first.folder


def test_concurrent_fillers_fill_once_and_a_failed_fill_leaves_nothing(soup_home):
    from soup_core.data.cache import cache_root, entries, filled

    calls: list[int] = []

    def fill(folder: Path) -> dict:
        calls.append(1)
        time.sleep(0.3)  # long enough for the other filler to arrive and wait on the lock
        (folder / "x.bin").write_bytes(b"1" * 10)
        return {"n": 1}

    results: list[tuple[Path, bool]] = []
    threads = [threading.Thread(target=lambda: results.append(filled("t", {"k": 1}, fill))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and sorted(r[1] for r in results) == [False, False, True]
    assert len({r[0] for r in results}) == 1

    def broken(folder: Path) -> dict:
        (folder / "half.bin").write_bytes(b"1")
        raise OSError("disk full")

    from soup_core.data import DataError

    with pytest.raises(DataError, match="cannot be used: disk full"):  # one message, the cache named
        filled("t", {"k": 2}, broken)
    assert [e["parts"] for e in entries()] == [{"k": 1}]
    assert sorted(p.name for p in cache_root().iterdir() if p.is_dir()) == [results[0][0].name]


def test_the_cache_is_bounded_least_recently_used_first(soup_home, monkeypatch):
    from soup_core.data.cache import entries, filled

    def fill(folder: Path) -> dict:
        (folder / "x.bin").write_bytes(b"1" * 400_000)
        return {}

    from soup_core.data import cache

    def exited() -> None:  # as if each use were by a process that has ended since: it holds no entry now
        for handle in cache._HELD.values():
            handle.close()
        cache._HELD.clear()

    monkeypatch.setenv("SOUP_DATA_CACHE_GB", str(1_000_000 / 1024**3))  # room for two entries
    a, _ = filled("t", {"k": "a"}, fill)
    time.sleep(0.02)
    filled("t", {"k": "b"}, fill)
    exited()
    time.sleep(0.02)
    assert not filled("t", {"k": "a"}, fill)[1]  # a is used again: b is now the least recently used
    time.sleep(0.02)
    filled("t", {"k": "c"}, fill)
    assert sorted(e["parts"]["k"] for e in entries()) == ["a", "c"]
    # control: an entry a live process still holds is never pruned (this process holds a and c now)
    filled("t", {"k": "d"}, fill)
    assert sorted(e["parts"]["k"] for e in entries()) == ["a", "c", "d"]


def test_dry_run_fills_the_cache_train_reads_it_and_soup_cache_lists_and_clears(tmp_path, soup_home, tiny_model):
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    write_yaml(tmp_path / "soup.yaml", {"base": str(tiny_model), "task": "sft", "output": str(tmp_path / "out"),
                                        "data": {"train": "train.jsonl", "max_length": 64},
                                        "training": {"max_steps": 2, "batch_size": 2}})
    env = {"SOUP_HOME": str(soup_home)}
    dry = run_soup(["train", "--config", str(tmp_path / "soup.yaml"), "--dry-run"], env=env, cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    train = run_soup(["train", "--config", str(tmp_path / "soup.yaml")], env=env, cwd=tmp_path, timeout=300)
    assert train.returncode == 0, train.stderr
    # max_steps 2 x batch 2: the dry run prepared the (2 + 1 + 2) x 2 rows the run can reach, and the run read them
    assert "prepared data encoded now: 10 of 40 rows, the ones training.max_steps=2 can reach" in dry.stdout
    assert "prepared data from the cache: 10 of 40 rows" in train.stdout and "tokenising" not in train.stdout
    listed = run_soup(["cache", "list"], env=env)
    assert listed.returncode == 0 and "2 entries" in listed.stdout, listed.stdout  # the rows and their tokens
    assert "rows of train.jsonl" in listed.stdout and "task sft, max_length 64" in listed.stdout
    cleared = run_soup(["cache", "clear"], env=env)
    assert cleared.returncode == 0 and "removed 2 entries" in cleared.stdout
    assert "0 entries" in run_soup(["cache", "list"], env=env).stdout


def test_a_subclass_that_overrides_encode_without_its_own_version_is_not_cached(setup):
    from soup_core.default_plugins.prepared import cacheable

    class Weighted(type(setup.task)):
        def encode(self, rows, tokenizer, config):
            return [{**e, "weight": 2.0} for e in super().encode(rows, tokenizer, config)]

    class Versioned(Weighted):  # declares a version beside its encode
        encoding_version = 1
        encode = Weighted.encode

    assert cacheable(setup.task) and not cacheable(Weighted()) and cacheable(Versioned())


@pytest.mark.parametrize("val_split", [0.2, 0.0])  # with rows held out, and every row in one pass
def test_the_cached_training_list_is_the_built_one_and_follows_the_files(tmp_path, soup_home, val_split):
    from soup_core.data import build_training_list
    from soup_core.data.rows_cache import ArrowRows, cached_training_list
    from soup_core.default_plugins.formats import BUILTIN_FORMATS

    formats = {f.name: f for f in BUILTIN_FORMATS}
    odd = {"messages": [{"role": "user", "content": "lone \ud800 surrogate, 東京 🎉"},
                        {"role": "assistant", "content": "ok"}]}
    write_jsonl(tmp_path / "a.jsonl", [*ROWS[:20], {"messages": "not a list"}, odd])
    write_jsonl(tmp_path / "b.jsonl", ROWS[20:])
    data = {"train": ["a.jsonl", "b.jsonl"], "val_split": val_split, "seed": 3, "on_bad_row": "skip", "format": "chat"}

    def both():
        return (build_training_list(data, formats=formats, base_dir=tmp_path),
                cached_training_list(data, formats=formats, base_dir=tmp_path))

    built, cached = both()
    assert isinstance(cached.rows, ArrowRows)
    for name in ("fingerprint", "format", "source", "detected", "n_rows", "n_val"):
        assert getattr(cached, name) == getattr(built, name), name
    assert list(cached.rows) == built.rows and list(cached.val_rows) == built.val_rows
    assert cached.rows[5] == built.rows[5] and cached.rows[-1] == built.rows[-1]
    assert list(cached.origins) == built.origins and cached.origins[19] == built.origins[19]
    assert [str(e) for e in cached.skipped] == [str(e) for e in built.skipped] and len(built.skipped) == 1
    assert [f.rows for f in cached.files] == [f.rows for f in built.files]
    assert sum(f.rows for f in cached.files) == cached.n_rows == 41 - cached.n_val  # 42 lines, one bad
    again = cached_training_list(data, formats=formats, base_dir=tmp_path)
    assert again.rows.path == cached.rows.path  # control: same files, same entry
    write_jsonl(tmp_path / "b.jsonl", ROWS[20:-1])  # one row fewer in the second file
    built, cached = both()
    assert cached.rows.path != again.rows.path and cached.n_rows == built.n_rows
    assert list(cached.rows) == built.rows and cached.fingerprint == built.fingerprint


def test_encoding_in_several_processes_gives_the_same_rows_and_names_a_bad_row(setup, monkeypatch):
    import os

    from soup_core.default_plugins import prepared as prepared_module
    from soup_core.default_plugins.sft import EncodingError, encode_rows

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: encoding stays in one process")
    monkeypatch.setattr(prepared_module, "CHUNK", 4)
    training = setup.training()
    said: list[str] = []
    got = prepared_module.prepare_encoded(setup.task, training, setup.tokenizer, _config(), report=said.append)
    assert got.meta["train"].get("workers", 1) >= 2  # control: it did run in several processes
    expected = encode_rows(training.rows, setup.tokenizer, max_length=64)
    assert [(e["input_ids"], e["labels"], e["row_index"]) for e in got.train.to_list()] == [
        (e["input_ids"], e["labels"], e["row_index"]) for e in expected]
    bad = [*training.rows[:30], {"odd": "row"}, *training.rows[30:]]
    with pytest.raises(EncodingError, match=r"^training row 30: the sft task cannot train on an example with keys"):
        prepared_module.prepare_encoded(setup.task, SimpleNamespace(rows=bad, val_rows=[], fingerprint="x"),
                                        setup.tokenizer, _config())


def test_max_steps_prepares_only_the_rows_the_run_reaches(setup):
    from soup_core.data import micro_batches
    from soup_core.default_plugins.prepared import prepare_encoded, rows_used

    training = setup.training()  # 36 training rows
    config = _config()
    config.training = SimpleNamespace(max_steps=3, gradient_accumulation_steps=2, batch_size=2)
    used = rows_used(config, 36)
    # (3 steps + 1) x 2 micro-batches + 2 read ahead by the data loader
    reached = {r for b in micro_batches(36, batch_size=2, epoch=0, seed=0)[:10] for r in b}
    assert used == sorted(reached) and len(used) == 20
    config.training.max_steps = 1  # two ranks: (1 + 1) x 2 + 2 micro-batches of each
    assert rows_used(config, 36, world_size=2) == sorted(
        {r for rank in (0, 1) for b in micro_batches(36, batch_size=2, epoch=0, seed=0, rank=rank, world_size=2)[:6]
         for r in b})
    config.training.max_steps = 3  # two ranks: 10 micro-batches each, past an epoch of 9: every row
    assert rows_used(config, 36, world_size=2) is None
    config.training.max_steps = 17  # an epoch: every row
    assert rows_used(config, 36) is None
    config.training.max_steps = 3
    got = prepare_encoded(setup.task, training, setup.tokenizer, config)
    rows = got.train.to_list()
    assert [r["row_index"] for r in rows] == list(range(36))
    assert {r["row_index"] for r in rows if r["input_ids"]} == reached  # only those rows are encoded
    full = prepare_encoded(setup.task, training, setup.tokenizer, _config())
    assert full.folder != got.folder and all(r["input_ids"] for r in full.train.to_list())


def test_the_collator_refuses_a_row_that_was_not_prepared():
    from soup_core.default_plugins.transformers.trainer import RowCollator

    collate = RowCollator(pad_token_id=0, packing=False)
    assert collate([{"input_ids": [1, 2], "labels": [1, 2], "row_index": 0}])["input_ids"].shape == (1, 2)
    with pytest.raises(RuntimeError, match=r"training rows \[7\] were not prepared"):
        collate([{"input_ids": [1, 2], "labels": [1, 2], "row_index": 0},
                 {"input_ids": [], "labels": [], "row_index": 7}])


@pytest.mark.parametrize("case", ["bad row", "empty", "all bad", "bad setting"])
def test_the_cached_training_list_fails_as_the_built_one(tmp_path, soup_home, case):
    from soup_core.data import DataError, build_training_list
    from soup_core.data.cache import entries
    from soup_core.data.rows_cache import cached_training_list
    from soup_core.default_plugins.formats import BUILTIN_FORMATS

    formats = {f.name: f for f in BUILTIN_FORMATS}
    rows = {"bad row": [*ROWS[:3], {"messages": []}, *ROWS[3:5]], "empty": [], "all bad": [{"messages": []}] * 2,
            "bad setting": ROWS[:3]}[case]
    (tmp_path / "t.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    data = {"train": "t.jsonl", "format": "chat", "on_bad_row": "skip" if case == "all bad" else "error"}
    if case == "bad setting":
        data["val_split"] = 1.5
    with pytest.raises(DataError) as built:
        build_training_list(data, formats=formats, base_dir=tmp_path)
    with pytest.raises(DataError) as cached:
        cached_training_list(data, formats=formats, base_dir=tmp_path)
    assert str(cached.value) == str(built.value) and cached.value.fix == built.value.fix
    assert entries() == []  # nothing is left in the cache


_HOLDER = """
import sys, time
from pathlib import Path
from soup_core.data.cache import filled

go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.01)

def fill(folder):
    time.sleep(1.0)  # the other process arrives meanwhile and waits to fill the same entry
    (folder / "x.bin").write_bytes(b"1")
    return {}

folder, now = filled("t", {"k": "ranks"}, fill)
print("filled" if now else "read", flush=True)
sys.stdin.read()  # keep the entry's shared lock, as a rank does until its run ends
"""


def test_two_processes_that_keep_an_entry_both_get_it(tmp_path, soup_home):
    """Two ranks start on a missing entry: one fills it and keeps holding it (shared) for its whole run; the
    other must then read it, not wait on that shared lock forever (a two-process run once hung here)."""
    import os
    import subprocess
    import sys

    script, go = tmp_path / "holder.py", tmp_path / "go"
    script.write_text(_HOLDER)
    env = {**os.environ, "SOUP_HOME": str(soup_home)}
    procs = [subprocess.Popen([sys.executable, str(script), str(go)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    said: list[str] = []
    try:
        time.sleep(0.5)  # both started and waiting for the word
        go.touch()
        readers = [threading.Thread(target=lambda p=p: said.append(p.stdout.readline().strip())) for p in procs]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=15)
        assert sorted(said) == ["filled", "read"]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
