"""``soup export``: the core's command dispatches ``--to`` to the format a plugin registered
(``soup_register_export_targets``), passes only the options the user gave, refuses the others and an unknown
format, and two plugins cannot register one format."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from soup_core import hookimpl
from soup_core.contracts import ExportTarget


def _plugin(calls: list, name: str = "demo") -> types.SimpleNamespace:
    def run(target: str, output: Path | None = None, type: str | None = None) -> None:  # noqa: A002
        calls.append((target, output, type))

    @hookimpl
    def soup_register_export_targets() -> list[ExportTarget]:
        return [ExportTarget(name=name, run=run, help=f"{name}: writes a demo file", options=("output", "type"))]

    return types.SimpleNamespace(SOUP_HOOK_API=(1, 1), soup_register_export_targets=soup_register_export_targets)


def _soup(plugin, *args: object) -> int:
    from soup_core.cli.main import main
    from soup_core.testing import registered_plugin

    with registered_plugin("demo", plugin), pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    return exit_info.value.code or 0


def test_dispatch_passes_the_given_options_only(tmp_path: Path, capsys) -> None:
    calls: list = []
    assert _soup(_plugin(calls), "export", "latest", "--to", "demo", "--type", "f16") == 0
    assert _soup(_plugin(calls), "export", "out", "--to", "demo", "-o", tmp_path / "x") == 0
    assert calls == [("latest", None, "f16"), ("out", tmp_path / "x", None)]


def test_refusals_name_the_formats_and_the_options(capsys) -> None:
    calls: list = []
    assert _soup(_plugin(calls), "export", "out", "--to", "nope") == 1
    err = capsys.readouterr().err
    assert "error: --to nope: unknown format; choose one of: demo" in err and err.count("error:") == 1
    assert "--to demo (demo plugin): writes a demo file" in err
    assert _soup(_plugin(calls), "export", "out", "--to", "demo", "--base", "b") == 1
    assert "--base does not apply to --to demo (it takes -o, --type); leave it out" in capsys.readouterr().err
    assert calls == []  # control: nothing ran for a refused command


def test_two_plugins_cannot_register_one_format() -> None:
    from soup_core.testing import isolated_plugins

    plugins = isolated_plugins(("demo", _plugin([])), ("other", _plugin([])))
    assert list(plugins.export_targets) == ["demo"] and plugins.export_targets.owner("demo") == "demo"
    assert plugins.plugins["other"].status == "failed"
    reason = plugins.plugins["other"].reason
    assert "export target 'demo' is provided by both plugin 'demo' and plugin 'other'" in reason
