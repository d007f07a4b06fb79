"""Shared fixtures: an isolated SOUP_HOME (so no test touches ~/.soup) and a CLI runner."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from typer.testing import CliRunner

HERE = Path(__file__).resolve().parent
FIXTURE_LOG = HERE / "seed-example.jsonl"


@pytest.fixture(autouse=True)
def soup_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path_factory.mktemp("soup_home")
    monkeypatch.setenv("SOUP_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "100")
    return home


@pytest.fixture
def fixture_log() -> Path:
    return FIXTURE_LOG


@pytest.fixture
def rewind_cli(monkeypatch: pytest.MonkeyPatch) -> Callable[..., object]:
    """``rewind_cli(args, cwd=...)`` runs the command through typer's CliRunner."""
    from soup_plugin_rewind.cli import app

    def invoke(args: Sequence[str], cwd: Path | None = None) -> object:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        return CliRunner().invoke(app, [os.fspath(a) for a in args], catch_exceptions=False)

    return invoke
