"""The watchdog on the mlx backend (training.watchdog): its non-finite rule runs in the mlx trainer (a NaN
step's update applies nothing, 5 in a row stop the run as failed); its divergence rule does not, which the
pre-flight says in one line, and an explicit ``training.watchdog: true`` is refused with that reason, as is
the rewind plugin's spike guard (no support row): exit 1, a refused run (``soup train --help``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

SETTINGS = {"batch_size": 4, "learning_rate": 1e-2, "max_steps": 3, "seed": 0, "scheduler": "constant"}


def _weights(folder: Path) -> dict:
    import mlx.core as mx

    from soup_plugin_mlx import adapters

    return mx.load(str(folder / adapters.ADAPTER_WEIGHTS))


def _same(a: dict, b: dict) -> bool:
    import mlx.core as mx

    assert set(a) == set(b) and a
    return all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.mark.slow
def test_a_nonfinite_step_applies_nothing_and_a_run_of_them_stops(run_backend, write_data, monkeypatch):
    data = write_data(24)
    two = run_backend("mlx", data, training={**SETTINGS, "max_steps": 2})
    three = run_backend("mlx", data, training=SETTINGS)
    monkeypatch.setenv("SOUP_TEST_NONFINITE_STEPS", "3")
    skipped = run_backend("mlx", data, training=SETTINGS)
    assert skipped.summary["status"] == "completed"
    assert [m.get("update_skipped") for _, m in skipped.metrics] == [None, None, 1.0]
    assert math.isnan(skipped.losses[2]) and "step 3: update skipped" in " ".join(skipped.lines)
    assert _same(_weights(skipped.output), _weights(two.output))  # the weights of two steps, exactly
    assert not _same(_weights(three.output), _weights(two.output))  # control: a clean third step moves them

    import mlx.core as mx

    monkeypatch.setenv("SOUP_TEST_NONFINITE_STEPS", "2")  # the moments kept no NaN: step 3 trains cleanly
    later = run_backend("mlx", data, training=SETTINGS)
    assert math.isfinite(later.losses[2]) and not later.metrics[2][1].get("update_skipped")
    assert all(mx.all(mx.isfinite(v)).item() for v in _weights(later.output).values())
    assert not _same(_weights(later.output), _weights(two.output))  # and it was applied

    monkeypatch.setenv("SOUP_TEST_NONFINITE_STEPS", "all")
    stopped = run_backend("mlx", data, training={**SETTINGS, "max_steps": 20})
    assert stopped.summary["status"] == "stopped" and stopped.summary["stop_failed"] is True
    assert stopped.summary["steps"] == 5 and "training.learning_rate" in stopped.summary["stop_reason"]
    assert "not finite at 5 steps in a row (1-5" in stopped.summary["stop_reason"]

    off = run_backend("mlx", data, training={**SETTINGS, "watchdog": False})  # control: the watchdog off
    assert off.summary["status"] == "completed" and not off.metric("update_skipped")
    assert not all(mx.all(mx.isfinite(v)).item() for v in _weights(off.output).values())  # NaN trained in


def _soup(args: list[str]) -> int:
    from soup_core.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code or 0


@pytest.mark.parametrize(
    "extra, code, said",
    [
        ("", 0, "watchdog off: its divergence rule (the mlx trainer measures no update size"),
        ("  watchdog: true\n", 1, "training.watchdog: true, but the mlx backend runs only the watchdog's "
         "non-finite rule (the mlx trainer measures no update size"),
        ("  spike_guard: quarantine\n", 1, "the mlx trainer has no update gate"),
    ],
)
def test_the_preflight_says_what_of_the_watchdog_runs_and_refuses_the_rest(
    tmp_path: Path, tiny_model: Path, write_data, monkeypatch, capsys, extra, code, said
) -> None:
    monkeypatch.chdir(tmp_path)
    write_data(8)
    (tmp_path / "soup.yaml").write_text(
        f"base: {tiny_model}\nbackend: mlx\noutput: ./output\ndata:\n  train: data.jsonl\n  max_length: 64\n"
        f"training:\n  batch_size: 4\n  max_steps: 1\n{extra}", encoding="utf-8"
    )
    assert _soup(["train", "--dry-run"]) == code
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert said in text
    assert ("watchdog off" in text) == (code == 0)  # one line, where the run goes ahead
    assert not (tmp_path / "output").exists()


@pytest.mark.slow
def test_a_run_the_watchdog_stops_exits_1_and_is_recorded_stopped(
    tmp_path: Path, tiny_model: Path, write_data, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SOUP_TEST_NONFINITE_STEPS", "all")
    write_data(24)
    (tmp_path / "soup.yaml").write_text(
        f"base: {tiny_model}\nbackend: mlx\noutput: ./output\ndata:\n  train: data.jsonl\n  max_length: 64\n"
        "training:\n  batch_size: 4\n  max_steps: 20\n", encoding="utf-8"
    )
    assert _soup(["train"]) == 1
    assert "training.learning_rate" in " ".join(capsys.readouterr().err.split())
    from soup_core import Tracker

    (run,) = Tracker().list_runs()
    assert run.status == "stopped" and "not finite at 5 steps in a row" in (run.error or "")
    assert [m.get("update_skipped") for _, m in Tracker().metrics(run.run_id)] == [1.0] * 5
