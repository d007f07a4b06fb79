"""`soup --help`, `--version`, `plugins list` and `runs` never import heavy libraries (fresh subprocess),
with a control showing the probe does see such an import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "trl", "bitsandbytes", "mlx", "mlx_lm", "datasets", "accelerate")

PROBE = """
import json, sys
args, heavy_names, pre_import = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
if pre_import:
    __import__(pre_import)
from soup_core.cli.main import main
code = 0
try:
    main(args)
except SystemExit as exc:
    code = exc.code or 0
print("CODE=" + str(code), file=sys.stderr)
print("HEAVY=" + json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(heavy_names))), file=sys.stderr)
"""


def heavy_imports(
    args: list[str], tmp_path: Path, pre_import: str = "", heavy: tuple[str, ...] = HEAVY
) -> list[str]:
    """The ``heavy`` modules loaded by `soup ARGS` in a fresh interpreter; the command must succeed."""
    path = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, SOUP_HOME=str(tmp_path), PYTHONPATH=path)
    cmd = [sys.executable, "-c", PROBE, json.dumps(args), json.dumps(heavy), pre_import]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    codes = [ln for ln in proc.stderr.splitlines() if ln.startswith("CODE=")]
    assert codes, proc.stderr
    # `soup runs` with no runs recorded exits 1 by design; everything else here must succeed
    assert codes[-1] == "CODE=0" or args == ["runs"], proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("HEAVY=")]
    assert line, proc.stderr
    return json.loads(line[-1][len("HEAVY="):])


@pytest.mark.parametrize(
    "args",
    [["--help"], ["--version"], ["plugins", "list"], ["plugins", "list", "--json"], ["runs"], ["runs", "--help"],
     ["train", "--help"], ["rewind", "--help"], ["cache", "list"],
     ["rewind", str(REPO / "plugins" / "soup_plugin_rewind" / "tests" / "seed-example.jsonl")],
     ["rewind", str(REPO / "plugins" / "soup_plugin_rewind" / "tests" / "seed-example.jsonl"), "--rows"]],
)
def test_light_commands_import_no_heavy_library(args: list[str], tmp_path: Path) -> None:
    assert heavy_imports(args, tmp_path) == []


def test_control_probe_detects_a_heavy_import(tmp_path: Path) -> None:
    # the same harness, with torch imported before the command: the probe must report it
    assert "torch" in heavy_imports(["--help"], tmp_path, pre_import="torch")


#: what building a config schema costs; `soup --help` with every installed plugin must not pay it (plugins
#: name their pydantic-built field types as "module:attr")
SCHEMA_LIBRARIES = ("pydantic", "pydantic_core", "annotated_types")


def test_help_with_every_installed_plugin_imports_no_schema_library(tmp_path: Path) -> None:
    assert heavy_imports(["--help"], tmp_path, heavy=SCHEMA_LIBRARIES) == []


def test_control_the_schema_probe_sees_pydantic(tmp_path: Path) -> None:
    assert "pydantic" in heavy_imports(["--help"], tmp_path, pre_import="pydantic", heavy=SCHEMA_LIBRARIES)


def test_help_imports_no_packaging(tmp_path: Path) -> None:
    # reading the plugins' soup-core ranges needs packaging; the top-level help lists commands without them
    assert heavy_imports(["--help"], tmp_path, heavy=("packaging",)) == []


def test_control_the_packaging_probe_sees_it(tmp_path: Path) -> None:
    assert heavy_imports(["plugins", "list"], tmp_path, heavy=("packaging",)) == ["packaging"]
