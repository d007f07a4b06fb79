"""``soup tui`` driven headless by textual's own pilot: a real run training in another process while the app
watches (its steps arrive, then it completes), a finished run replayed whole, the keys, a bad RUN, and the
message without textual."""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("textual")

REPO = Path(__file__).resolve().parents[3]
ROWS = [{"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
        for i in range(16)]
STEPS = 300


def _shown(app: Any, widget: str) -> str:
    from textual.widgets import Static

    return str(app.query_one(f"#{widget}", Static).content)


async def _first_view(app: Any, pilot: Any) -> None:
    for _ in range(600):
        if app.view is not None:
            return
        await pilot.pause(0.05)
    raise AssertionError(f"the app never read the run: {app.problem}")


def _spike_at(home: Path, run_id: str, step: int) -> None:
    """A loss spike written into the tracker (rewind's rule flags it: 50 against a median near 7)."""
    with sqlite3.connect(home / "experiments.db") as db:
        db.execute("UPDATE metrics SET value = 50 WHERE run_id = ? AND key = 'loss' AND step = ?", (run_id, step))


def test_tui_follows_a_run_training_in_another_process(helpers: Any, tiny_model: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from soup_core.testing import write_jsonl, write_yaml
    from soup_plugin_observe.tui import RunApp

    home = tmp_path / "home"
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    cfg = write_yaml(tmp_path / "soup.yaml", {
        "base": str(tiny_model), "output": str(tmp_path / "out"), "data": {"train": "train.jsonl", "max_length": 32},
        "training": {"max_steps": STEPS, "batch_size": 2, "logging_steps": 1, "save_steps": 100}})
    monkeypatch.setenv("SOUP_HOME", str(home))
    proc = helpers.soup_process(["train", "-c", str(cfg)], home)
    try:
        out: list[str] = []
        for line in proc.stdout:  # the run is registered and stepping: start watching
            out.append(line)
            if line.startswith("step 1/"):
                break
        else:
            raise AssertionError("".join(out) + proc.stderr.read())
        threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()  # keep the pipe drained

        async def watch() -> tuple[list[int], list[str], Any]:
            app = RunApp("latest", poll=0.1)  # a fast machine trains 300 steps in a few seconds: read often
            steps: list[int] = []
            states: list[str] = []
            async with app.run_test(size=(120, 40)) as pilot:
                await _first_view(app, pilot)
                deadline = time.monotonic() + 180
                while time.monotonic() < deadline:
                    status = _shown(app, "status")
                    step = int(re.search(r"· step (\d+)", status).group(1))
                    if not steps or steps[-1] != step:
                        steps.append(step)
                    if not states or states[-1] != status.split(" · ")[1]:
                        states.append(status.split(" · ")[1])
                    if not app.view.live:
                        break
                    await pilot.pause(0.05)
                await pilot.press("q")
            return steps, states, app

        steps, states, app = asyncio.run(watch())
        assert proc.wait(timeout=60) == 0, "".join(out) + proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert states[0].startswith(f"training (process {proc.pid}"), states  # it watched the run while it trained
    assert len(steps) >= 3 and steps == sorted(steps) and steps[-1] == STEPS, steps  # steps arrived over time
    assert states[-1].startswith("completed"), states  # ... and the run ended: the app says how
    assert app.view.steps == STEPS and app.view.status == "completed"
    assert [e for e in app.view.events if "checkpoint saved: checkpoint-300" in e]

    # the spike table with the rows behind the spike and their previews (the data set rebuilt, as soup rewind)
    _spike_at(home, app.view.run_id, 150)

    async def spikes() -> str:
        again = RunApp(app.view.run_id)
        async with again.run_test(size=(140, 40)) as pilot:
            await _first_view(again, pilot)
            return _shown(again, "spikes-body")

    shown = asyncio.run(spikes())
    assert re.search(r"warning\s+150\s+50\.0000", shown), shown
    assert "Step 150 rows" in shown and re.search(r"user: question \d+\? assistant: answer \d+\.", shown), shown


def test_tui_replays_a_finished_run_whole(recorded: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from soup_plugin_observe.tui import RunApp

    home = tmp_path / "home"
    run_id = recorded(home, tmp_path / "out", 250)
    _spike_at(home, run_id, 120)
    monkeypatch.setenv("SOUP_HOME", str(home))

    async def replay() -> tuple[Any, dict[str, str], int]:
        app = RunApp(run_id)
        async with app.run_test(size=(120, 40)) as pilot:
            await _first_view(app, pilot)
            await pilot.pause(1.5)  # a finished run is read once: no timer re-reads it
            return app, {w: _shown(app, w) for w in ("status", "curves-body", "events-body", "spikes-body")}, app.reads

    app, shown, reads = asyncio.run(replay())
    assert app.view.steps == 250 and not app.view.live and reads == 1
    assert "loss: 250 points, steps 1–250" in shown["curves-body"]
    assert "learning rate: 250 points" in shown["curves-body"] and "grad norm: 250 points" in shown["curves-body"]
    assert "eval loss: 2 points" in shown["curves-body"]  # every 100 steps
    assert "completed" in shown["status"] and "step 250" in shown["status"] and "replay" in shown["status"]
    assert [e for e in shown["events-body"].splitlines() if "eval loss" in e and "100" in e]
    assert re.search(r"warning\s+120\s+50\.0000", shown["spikes-body"])
    assert "rows behind step 120" in shown["spikes-body"] and "rewind.jsonl" in shown["spikes-body"]  # none kept


def test_tui_keys_tab_switches_panes_and_q_quits(recorded: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from soup_plugin_observe.tui import RunApp

    home = tmp_path / "home"
    run_id = recorded(home, tmp_path / "out", 20)
    monkeypatch.setenv("SOUP_HOME", str(home))

    async def keys() -> tuple[list[str], list[bool]]:
        app = RunApp(run_id)
        panes, running = [], []
        async with app.run_test() as pilot:
            await _first_view(app, pilot)
            panes.append(app.pane)
            for key in ("tab", "tab", "tab", "shift+tab"):
                await pilot.press(key)
                panes.append(app.pane)
            await pilot.press("x")  # the control: another key does not quit
            running.append(app.is_running)
            await pilot.press("q")
            await pilot.pause()
            running.append(app.is_running)
        return panes, running

    panes, running = asyncio.run(keys())
    assert panes == ["curves", "events", "spikes", "curves", "spikes"]
    assert running == [True, False]


def _cli(code: str, home: Path) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SOUP_HOME": str(home), "PYTHONPATH": path})


def test_tui_bad_run_one_plain_message_exit_1(recorded: Any, tmp_path: Path) -> None:
    recorded(tmp_path, tmp_path / "out", 5)
    proc = _cli("from soup_core.cli.main import main; main(['tui', 'no-such-run'])", tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["error: no run matches 'no-such-run'; soup runs lists them"]


def test_tui_without_textual_says_how_to_install_it(tmp_path: Path) -> None:
    blocked = _cli("import sys; sys.modules['textual'] = None\n"
                   "from soup_core.cli.main import main; main(['tui'])", tmp_path)
    assert blocked.returncode == 1 and "Traceback" not in blocked.stderr
    assert blocked.stderr.strip().splitlines() == [
        'error: soup tui needs textual, which is not installed: pip install "soup-plugin-observe[tui]" '
        "(or pip install textual)"]
    # the control: with textual importable, the same call gets past that check (to the empty tracker)
    found = _cli("from soup_core.cli.main import main; main(['tui'])", tmp_path)
    assert found.returncode == 1 and "pip install" not in found.stderr and "no runs recorded" in found.stderr
