"""The rows cache filled ahead in a forked process while the parent imports the backend (``fill_ahead``): the
parent reads the child's entry (the same list as one built directly), and a fill that failed leaves the parent
to fill again and report the error as it would have."""

from __future__ import annotations

import json
import os

import pytest

from soup_core.testing import write_jsonl

pytest_plugins = ["soup_core.testing"]

ROWS = [{"messages": [{"role": "user", "content": f"question {i} " * (1 + i % 4)},
                      {"role": "assistant", "content": f"answer {i}"}]} for i in range(60)]


@pytest.fixture()
def fills(tmp_path, monkeypatch):
    """Each rows-cache fill appends the id of the process that ran it to a file (shared across the fork)."""
    from soup_core.data import rows_cache

    log = tmp_path / "fills.log"
    real = rows_cache._stream_fill

    def logged(*args, **kwargs):
        with log.open("a") as handle:
            handle.write(f"{os.getpid()}\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(rows_cache, "_stream_fill", logged)
    return lambda: [int(line) for line in log.read_text().split()] if log.is_file() else []


@pytest.mark.parametrize("ahead", [True, False])  # False: the control, below the size that pays for a process
def test_the_rows_filled_ahead_are_read_by_the_parent(tmp_path, soup_home, monkeypatch, fills, ahead):
    from soup_core.data import build_training_list, rows_cache
    from soup_core.default_plugins.formats import BUILTIN_FORMATS

    formats = {f.name: f for f in BUILTIN_FORMATS}
    monkeypatch.setattr(rows_cache, "AHEAD_BYTES", 1 if ahead else 1 << 40)
    write_jsonl(tmp_path / "t.jsonl", ROWS)
    data = {"train": "t.jsonl", "val_split": 0.1, "seed": 2, "format": "chat"}
    # reaped first: here nothing runs between the two, as the deep probe's imports do in a run (two processes
    # that want the entry at once take its lock, which the cache's own tests cover)
    rows_cache.fill_ahead(data, formats=formats, base_dir=tmp_path)()
    cached = rows_cache.cached_training_list(data, formats=formats, base_dir=tmp_path)
    built = build_training_list(data, formats=formats, base_dir=tmp_path)
    assert list(cached.rows) == built.rows and list(cached.val_rows) == built.val_rows
    assert cached.fingerprint == built.fingerprint and list(cached.origins) == built.origins
    assert len(fills()) == 1  # filled once, by one process
    assert (fills()[0] != os.getpid()) is ahead


def test_a_failed_fill_ahead_leaves_the_parent_to_report_the_error(tmp_path, soup_home, monkeypatch, fills):
    from soup_core.data import DataError, build_training_list, rows_cache
    from soup_core.data.cache import entries
    from soup_core.default_plugins.formats import BUILTIN_FORMATS

    formats = {f.name: f for f in BUILTIN_FORMATS}
    monkeypatch.setattr(rows_cache, "AHEAD_BYTES", 1)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*ROWS[:3], {"messages": []}]))
    data = {"train": "t.jsonl", "format": "chat"}
    rows_cache.fill_ahead(data, formats=formats, base_dir=tmp_path)()  # the child fails and is reaped
    assert len(fills()) == 1 and fills()[0] != os.getpid() and entries() == []
    with pytest.raises(DataError) as built:
        build_training_list(data, formats=formats, base_dir=tmp_path)
    with pytest.raises(DataError) as cached:
        rows_cache.cached_training_list(data, formats=formats, base_dir=tmp_path)
    assert str(cached.value) == str(built.value) and cached.value.fix == built.value.fix
    assert fills()[1:] == [os.getpid()] and entries() == []  # the parent filled again, and left nothing


@pytest.mark.parametrize("ahead", [True, False])
def test_plan_run_fills_the_rows_ahead(tmp_path, soup_home, tiny_model, monkeypatch, fills, ahead):
    from soup_core.config import load_config
    from soup_core.data import rows_cache
    from soup_core.plugins import load_plugins
    from soup_core.run import plan_run
    from soup_core.testing import write_yaml

    real = rows_cache.fill_ahead

    def waited(*args, **kwargs):  # the child's fill done before the parent goes on: the test sees who filled
        real(*args, **kwargs)()
        return lambda: None

    monkeypatch.setattr(rows_cache, "fill_ahead", waited)
    monkeypatch.setattr(rows_cache, "AHEAD_BYTES", 1 if ahead else 1 << 40)
    write_jsonl(tmp_path / "t.jsonl", ROWS)
    write_yaml(tmp_path / "soup.yaml", {"base": str(tiny_model), "task": "sft", "output": str(tmp_path / "out"),
                                        "data": {"train": "t.jsonl", "max_length": 64}})
    plan = plan_run(load_config(tmp_path / "soup.yaml"), plugins=load_plugins(), base_dir=tmp_path)
    assert plan.data["train"].n_rows == len(ROWS) and plan.data["train"].rows[7] == ROWS[7]
    assert len(fills()) == 1 and (fills()[0] != os.getpid()) is ahead


def test_a_refused_run_stops_its_fill_ahead(tmp_path, soup_home, tiny_model, monkeypatch):
    import time

    from soup_core.config import load_config
    from soup_core.data import rows_cache
    from soup_core.data.cache import cache_root
    from soup_core.plugins import load_plugins
    from soup_core.run import RunRefused, plan_run
    from soup_core.testing import write_yaml

    started = tmp_path / "started"
    real = rows_cache._stream_fill

    def slow(*args, **kwargs):  # the child's fill, long enough to be still running when the run is refused
        started.write_text(str(os.getpid()))
        time.sleep(120)
        return real(*args, **kwargs)

    plugins = load_plugins()

    def refuse(**_):
        while not started.exists():
            time.sleep(0.05)
        return ["refused by the test"]

    monkeypatch.setattr(rows_cache, "_stream_fill", slow)
    monkeypatch.setattr(rows_cache, "AHEAD_BYTES", 1)
    monkeypatch.setattr(plugins, "requirements_for", refuse)
    write_jsonl(tmp_path / "t.jsonl", ROWS)
    write_yaml(tmp_path / "soup.yaml", {"base": str(tiny_model), "task": "sft", "output": str(tmp_path / "out"),
                                        "data": {"train": "t.jsonl", "max_length": 64}})
    began = time.monotonic()
    with pytest.raises(RunRefused, match="refused by the test"):
        plan_run(load_config(tmp_path / "soup.yaml"), plugins=plugins, base_dir=tmp_path)
    assert time.monotonic() - began < 60  # not waiting for the fill
    with pytest.raises(ProcessLookupError):  # stopped and reaped (control: a fill left running answers here)
        os.kill(int(started.read_text()), 0)
    root = cache_root()
    assert not root.exists() or not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
