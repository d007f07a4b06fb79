"""``soup runs plot``: one line per run (and its eval loss dashed, and the learning rate), drawn by rewind's
curve code; a PNG where matplotlib is installed, and the fix where it is not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def two_runs(recorded: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    home = tmp_path_factory.mktemp("plot-home")
    return home, [recorded(home, home / "a", 200), recorded(home, home / "b", 300)]


def test_two_runs_give_two_loss_lines_and_their_eval(two_runs: tuple[Path, list[str]], monkeypatch) -> None:
    from soup_plugin_observe.facts import from_tracker
    from soup_plugin_observe.plot_cmd import panels_for

    home, ids = two_runs
    monkeypatch.setenv("SOUP_HOME", str(home))
    loss, rate = panels_for([from_tracker(i) for i in ids])
    solid = [line for line in loss.lines if not line.dashed]
    assert [line.label for line in solid] == [ids[0][-8:], ids[1][-8:]]
    assert [len(line.steps) for line in solid] == [200, 300]
    assert [len(line.steps) for line in loss.lines if line.dashed] == [2, 3]  # eval every 100 steps
    assert len(rate.lines) == 2 and rate.ylabel == "learning rate"
    one = panels_for([from_tracker(ids[0])])  # control: one run, one loss line
    assert len([line for line in one[0].lines if not line.dashed]) == 1


def test_the_png_is_written(two_runs: tuple[Path, list[str]], tmp_path: Path, monkeypatch, capsys) -> None:
    from soup_core.cli.main import main

    home, ids = two_runs
    monkeypatch.setenv("SOUP_HOME", str(home))
    target = tmp_path / "curves.png"
    with pytest.raises(SystemExit) as done:
        main(["runs", "plot", *ids, "-o", str(target)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the fix is said, and nothing is written
        assert done.value.code == 1 and "pip install matplotlib" in capsys.readouterr().err
        assert not target.exists()
        return
    assert done.value.code in (0, None)
    data = target.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_a_run_with_no_loss_is_refused(recorded: Any, tmp_path: Path, monkeypatch, capsys) -> None:
    from soup_core.cli.main import main

    rid = recorded(tmp_path, tmp_path / "x", 0, status="failed", error="RuntimeError: before step 1")
    monkeypatch.setenv("SOUP_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as done:
        main(["runs", "plot", rid, "-o", str(tmp_path / "c.png")])
    assert done.value.code == 1 and "recorded no loss" in capsys.readouterr().err
