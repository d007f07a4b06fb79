"""``soup why``, ``soup bundle``, ``soup runs plot`` and ``soup tui`` import no torch, transformers, peft or trl (a
fresh process each), with a control showing the probe sees such an import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "transformers", "peft", "trl", "bitsandbytes", "datasets", "accelerate")
PROBE = """
import json, sys
args, heavy, pre = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
if pre:
    __import__(pre)
from soup_core.cli.main import main
code = 0
try:
    main(args)
except SystemExit as exc:
    code = exc.code or 0
print("CODE=" + str(code), file=sys.stderr)
print("HEAVY=" + json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(heavy))), file=sys.stderr)
"""
#: ``soup tui RUN`` as the CLI starts it, its app run headless by textual's pilot until it has drawn the run, then q
TUI_PROBE = PROBE.replace("from soup_core.cli.main import main", """import asyncio
import soup_plugin_observe.tui as tui
class Headless(tui.RunApp):
    def run(self):
        async def go():
            async with self.run_test() as pilot:
                while self.view is None:
                    await pilot.pause(0.05)
                assert self.view.steps > 0 and "loss:" in self.view.curves.plain, self.view
                await pilot.press("q")
        asyncio.run(go())
tui.RunApp = Headless
from soup_core.cli.main import main""")


def heavy_imports(args: list[str], home: Path, pre_import: str = "", probe: str = PROBE) -> tuple[int, list[str]]:
    env = dict(os.environ, SOUP_HOME=str(home), PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", probe, json.dumps(args), json.dumps(HEAVY), pre_import],
                          capture_output=True, text=True, env=env, timeout=120, cwd=home)
    code = [ln for ln in proc.stderr.splitlines() if ln.startswith("CODE=")]
    heavy = [ln for ln in proc.stderr.splitlines() if ln.startswith("HEAVY=")]
    assert code and heavy, proc.stderr
    return int(code[-1][5:]), json.loads(heavy[-1][6:])


@pytest.fixture(scope="module")
def run_id(recorded: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    home = tmp_path_factory.mktemp("light-home")
    return home, recorded(home, home / "out", 300, status="failed", error="RuntimeError: boom")


@pytest.mark.parametrize("args", [["why"], ["why", "--json"], ["bundle", "-o", "b.tar.gz"],
                                  ["runs", "plot", "-o", "c.png"], ["why", "b.tar.gz"]])
def test_the_commands_import_no_heavy_library(args: list[str], run_id: tuple[Path, str]) -> None:
    home, rid = run_id
    args = [*args[:1], *([rid] if args[0] == "bundle" else []), *args[1:]]
    if args[:2] == ["runs", "plot"]:
        args.insert(2, rid)
    if args == ["why", "b.tar.gz"] and not (home / "b.tar.gz").is_file():  # run alone (-k): make the bundle first
        heavy_imports(["bundle", rid, "-o", "b.tar.gz"], home)
    code, heavy = heavy_imports(args, home)
    assert heavy == []
    try:
        import matplotlib  # noqa: F401
        plotting = True
    except ImportError:
        plotting = False
    assert code == 0 or (args[:2] == ["runs", "plot"] and not plotting)  # without matplotlib: says so, exit 1


def test_control_the_probe_sees_a_heavy_import(run_id: tuple[Path, str]) -> None:
    home, _ = run_id
    assert heavy_imports(["why"], home, pre_import="torch")[1] == ["torch"]


@pytest.mark.parametrize("pre_import", ["", "torch"])
def test_tui_imports_no_heavy_library(pre_import: str, run_id: tuple[Path, str]) -> None:
    """The app on a run, drawn headless; with torch imported first, the control that the probe sees it."""
    pytest.importorskip("textual")
    home, rid = run_id
    code, heavy = heavy_imports(["tui", rid], home, pre_import=pre_import, probe=TUI_PROBE)
    assert code == 0 and heavy == ([pre_import] if pre_import else [])
