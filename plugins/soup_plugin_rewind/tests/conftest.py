"""Shared fixtures: the test kit (``soup_core.testing``), an isolated SOUP_HOME for every test (so no test
touches ~/.soup), the bundled example log and a CLI runner."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest_plugins = ["soup_core.testing"]

HERE = Path(__file__).resolve().parent
FIXTURE_LOG = HERE / "seed-example.jsonl"


@pytest.fixture(autouse=True)
def _isolated(soup_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test has its own SOUP_HOME, and 100 columns: the width the expected output is written for."""
    monkeypatch.setenv("COLUMNS", "100")


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
