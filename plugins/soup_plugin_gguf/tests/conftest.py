"""The core's test kit (``tiny_model``, ``soup_home``, ``real_model_folder``), a fresh SOUP_HOME for every test,
and ``soup``: the CLI in this process with this plugin registered."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytest_plugins = ["soup_core.testing"]


@pytest.fixture(autouse=True)
def _isolated(soup_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture
def soup() -> Callable[..., int]:
    """``soup(*args)``: run ``soup ARGS`` in this process (the installed plugins, this one as in this tree);
    returns the exit code."""
    import soup_plugin_gguf.plugin as gguf_plugin
    from soup_core.cli.main import main
    from soup_core.testing import registered_plugin

    def run(*args: object) -> int:
        with registered_plugin("gguf", gguf_plugin, entry_points=True), pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
        return exit_info.value.code or 0

    return run
