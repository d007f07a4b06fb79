"""The plugin imports only soup-core's public API: ``soup_core`` (the names it exports) and the modules
``hookspecs``, ``contracts``, ``events``, ``probes`` and ``testing``. Scanned with ``ast``, so an import
inside a function (where heavy imports live) is seen too; a control shows the scan catches each kind of
private import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1]
PUBLIC_MODULES = frozenset(
    {"soup_core", "soup_core.hookspecs", "soup_core.contracts", "soup_core.events", "soup_core.probes",
     "soup_core.testing", "soup_core.config", "soup_core.data", "soup_core.tracker",
     "soup_core.default_plugins.transformers", "soup_core.default_plugins.sft",
     "soup_core.default_plugins.formats"}
)


def private_imports(source: str, public_names: frozenset[str]) -> list[str]:
    """Every use of a non-public part of soup_core in ``source``: ``import soup_core.x``,
    ``from soup_core.x import y``, ``from soup_core import _private`` (a name soup_core does not export),
    and ``importlib.import_module("soup_core.x")`` / ``__import__("soup_core.x")`` with a literal name."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names
                      if a.name.startswith("soup_core") and a.name not in PUBLIC_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if not (node.module or "").startswith("soup_core"):
                continue
            if node.module not in PUBLIC_MODULES:
                found.append(f"from {node.module} import ...")
            elif node.module == "soup_core":
                found += [f"from soup_core import {a.name}" for a in node.names
                          if a.name not in public_names and f"soup_core.{a.name}" not in PUBLIC_MODULES]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            target = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(target, str) and \
                    target.startswith("soup_core") and target not in PUBLIC_MODULES:
                found.append(f"{name}({target!r})")
    return found


@pytest.fixture(scope="module")
def public_names() -> frozenset[str]:
    import soup_core

    return frozenset(soup_core.__all__)


def test_the_plugin_and_its_tests_import_only_the_public_api(public_names) -> None:
    files = sorted((PACKAGE / "src").rglob("*.py")) + sorted((PACKAGE / "tests").rglob("*.py"))
    assert len(files) >= 8
    problems = {
        str(path.relative_to(PACKAGE)): hits
        for path in files
        if (hits := private_imports(path.read_text(encoding="utf-8"), public_names))
    }
    assert problems == {}


@pytest.mark.parametrize(
    "source",
    [
        "import soup_core.default_plugins.transformers.trainer",
        "from soup_core import SoupTrainerMixin",
        "from soup_core import _LAZY",
        "def f():\n    from soup_core.data.build import canonical_row\n",
        "import importlib\nimportlib.import_module('soup_core.tracker.store')",
        "__import__('soup_core.default_plugins.commands.train_cmd')",
    ],
)
def test_control_each_kind_of_private_import_is_caught(source, public_names) -> None:
    assert private_imports(source, public_names) != []


def test_control_public_imports_pass(public_names) -> None:
    source = ("import soup_core\nfrom soup_core import Task, hookimpl\n"
              "from soup_core.default_plugins.transformers import SoupTrainerMixin\n"
              "from soup_core.testing import isolated_plugins\nfrom soup_core import probes\n")
    assert private_imports(source, public_names) == []
