"""The plugin and its tests import only soup-core's public API (docs/plugins.md, "Public API only"), as
the test kit's ``private_core_imports`` reads it: imports inside functions count too. Keep this test when
you copy the template."""

from __future__ import annotations

from pathlib import Path

from soup_core.testing import private_core_imports

PACKAGE = Path(__file__).resolve().parents[1]


def test_the_plugin_and_its_tests_import_only_the_public_api() -> None:
    files = sorted((PACKAGE / "src").rglob("*.py")) + sorted((PACKAGE / "tests").rglob("*.py"))
    assert len(files) >= 8
    problems = {
        str(path.relative_to(PACKAGE)): hits
        for path in files
        if (hits := private_core_imports(path.read_text(encoding="utf-8")))
    }
    assert problems == {}


def test_control_a_private_import_is_named() -> None:
    # a public default-plugin module passes; a private core module imported inside a function is named
    source = (
        "from soup_core.default_plugins.sft import encode_rows\n\n\n"
        "def f():\n    from soup_core.ui import console\n"
    )
    assert private_core_imports(source) == ["line 5: from soup_core.ui import console"]
