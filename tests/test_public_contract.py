"""``soup_core``'s public contract: at most 40 names in ``__all__``; each name that left it (docs/plugins.md,
"Migration") still resolves to the same object as its new import, with one ``DeprecationWarning`` naming that
import; any other name raises ``AttributeError``."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import soup_core

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "plugins.md"
ALIASES = dict(soup_core._MOVED)


def migration_table() -> dict[str, str]:
    """old name -> new module, as docs/plugins.md's "Migration" table lists them."""
    section = DOCS.read_text(encoding="utf-8").split("\n## Migration", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `soup_core\.(\w+)` \| `from ([\w.]+) import (\w+)` \|$", section, re.M)
    assert all(old == new for old, _, new in rows), rows
    return {old: module for old, module, _ in rows}


def test_all_has_at_most_40_names_and_each_resolves_without_a_warning() -> None:
    assert len(soup_core.__all__) <= 40
    assert len(set(soup_core.__all__)) == len(soup_core.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in soup_core.__all__:
            getattr(soup_core, name)


def test_the_migration_table_lists_exactly_the_aliases() -> None:
    assert migration_table() == ALIASES
    assert not set(ALIASES) & set(soup_core.__all__)


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_an_alias_warns_once_and_is_the_new_object(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(soup_core, "_warned", set())
    module = ALIASES[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = getattr(soup_core, name)
        namespace: dict[str, object] = {}
        exec(f"from soup_core import {name}", namespace)
        second = getattr(soup_core, name)
    assert first is namespace[name] is second is getattr(importlib.import_module(module), name)
    # importing the new module may warn too (torch does): keep soup_core's own warnings
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)
                    and str(w.message).startswith("soup_core.")]
    assert len(deprecations) == 1, [str(w.message) for w in deprecations]
    assert f"from {module} import {name}" in str(deprecations[0].message)
    assert deprecations[0].filename == __file__  # the warning points at the code that used the old name


@pytest.mark.parametrize(
    "name", ["TransformersBackend", "merge_adapter", "BUILTIN_FORMATS", "canonical_row", "err_console", "nope"]
)
def test_any_other_name_raises_attribute_error(name: str) -> None:
    # names public elsewhere (or nowhere) that soup_core never exported: no alias, no lookup elsewhere
    with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
        getattr(soup_core, name)
    with pytest.raises(ImportError):
        exec(f"from soup_core import {name}", {})


@pytest.mark.parametrize("name", ["Task", "load_config", "SFTTask"])
def test_control_a_public_name_and_an_alias_resolve_the_same_way(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec(f"from soup_core import {name}", {})
        assert getattr(soup_core, name) is not None


BOUND = """
import json, soup_core
before = sorted(n for n in vars(soup_core) if not n.startswith("_"))
import soup_core.ui
after = sorted(n for n in vars(soup_core) if not n.startswith("_"))
print(json.dumps([before, after]))
"""


def test_a_fresh_import_binds_only_public_names() -> None:
    out = subprocess.run([sys.executable, "-c", BOUND], capture_output=True, text=True, check=True, cwd=REPO)
    before, after = json.loads(out.stdout)
    # imported by soup_core itself: public modules (default_plugins: for the finder of the old module names)
    submodules = {"contracts", "default_plugins", "events", "hookspecs"}
    assert set(before) - set(soup_core.__all__) == submodules
    # control: the check sees a name that is not public (importing a submodule binds it on the package)
    assert set(after) - set(before) == {"ui"}
