"""No plugin in the repository uses soup-core outside its documented public API: the test kit's
``private_core_imports`` over every plugin's ``src/``, failing with each private import by file and line; a
control per kind of private import; the public modules are the ones docs/plugins.md lists."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from soup_core.testing import PUBLIC_MODULES, private_core_imports

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*REPO.glob("soup_plugin_*/src"), *REPO.glob("plugins/*/src")])


def private_imports_under(src: Path) -> dict[str, list[str]]:
    """file (relative to the repository) -> its private imports, for every Python file under ``src``."""
    return {
        str(path.relative_to(REPO)): hits
        for path in sorted(src.rglob("*.py"))
        if (hits := private_core_imports(path.read_text(encoding="utf-8")))
    }


def test_every_plugin_of_the_repository_is_scanned() -> None:
    names = {src.parent.name for src in SOURCES}
    assert {"soup_plugin_mlx", "soup_plugin_rl", "soup_plugin_streaming", "soup_plugin_rewind",
            "soup_plugin_unlearn", "soup_plugin_distill", "soup_plugin_example", "soup_plugin_focal",
            "soup_plugin_cloud", "soup_plugin_klsft"} <= names


@pytest.mark.parametrize("src", SOURCES, ids=lambda src: src.parent.name)
def test_a_plugin_uses_only_the_public_api(src: Path) -> None:
    assert private_imports_under(src) == {}


def test_control_a_plugin_with_a_private_import_fails_naming_it(tmp_path: Path) -> None:
    src = tmp_path / "plugins" / "soup_plugin_focal" / "src"
    shutil.copytree(REPO / "plugins" / "soup_plugin_focal" / "src", src)
    trainer = src / "soup_plugin_focal" / "trainer.py"
    trainer.write_text(trainer.read_text(encoding="utf-8") + "\nfrom soup_core.ui import console\n", encoding="utf-8")
    [(path, hits)] = {str(p.relative_to(tmp_path)): private_core_imports(p.read_text(encoding="utf-8"))
                      for p in src.rglob("*.py") if p.name == "trainer.py"}.items()
    assert path.endswith("soup_plugin_focal/trainer.py")
    assert hits == [f"line {len(trainer.read_text().splitlines())}: from soup_core.ui import console"]


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("import soup_core.ui", "import soup_core.ui"),  # a private module
        ("from soup_core.outputs import TMP_PREFIX", "from soup_core.outputs import TMP_PREFIX"),  # ... with from
        ("import soup_core.default_plugins.transformers.trainer",  # a default plugin's submodule
         "import soup_core.default_plugins.transformers.trainer"),
        ("from soup_core.default_plugins.commands.train_cmd import run_train_command",  # a private default plugin
         "from soup_core.default_plugins.commands.train_cmd import run_train_command"),
        ("from soup_core import SFTTask", "from soup_core import SFTTask"),  # a deprecated alias
        ("from soup_core import _LAZY", "from soup_core import _LAZY"),  # a private name of a public module
        ("from soup_core.data import build", "from soup_core.data import build"),  # a name it does not export
        ("import soup_core\nsoup_core.encode_rows([], None)", "soup_core.encode_rows"),  # an alias as an attribute
        ("import soup_core\nsoup_core.data.build.canonical_row", "soup_core.data.build.canonical_row"),
        ("def f():\n    from soup_core.tracker.store import Tracker",  # inside a function
         "from soup_core.tracker.store import Tracker"),
        ("import importlib\nimportlib.import_module('soup_core.tracker.store')",
         "import_module('soup_core.tracker.store')"),
        ("__import__('soup_core.cli.main')", "__import__('soup_core.cli.main')"),
    ],
)
def test_control_each_kind_of_private_import_is_named(source: str, named: str) -> None:
    line = len(source.splitlines())
    assert private_core_imports(source) == [f"line {line}: {named}"]


def test_control_the_public_api_passes() -> None:
    source = """
import soup_core
import soup_core.testing
from soup_core import ConfigField, Task, hookimpl, probes, testing
from soup_core.config import ConfigIssue
from soup_core.default_plugins import transformers
from soup_core.default_plugins.formats import BUILTIN_FORMATS
from soup_core.default_plugins.sft import SFTTask, encode_rows
from soup_core.default_plugins.transformers import SoupTrainerMixin, tiny_model_dir
from soup_core.events import RunStart
from soup_core.hookspecs import HOOK_API_VERSION
from soup_core.tracker import Tracker
soup_core.Tracker().get_run("latest")
soup_core.probes.distribution("torch")
soup_core.testing.write_jsonl
import importlib
importlib.import_module("soup_core.testing")
import soup_core_lookalike.ui
"""
    assert private_core_imports(source) == []


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module (soup_core.testing.private_core_imports)
        return False


def test_the_public_modules_are_the_documented_ones() -> None:
    docs = (REPO / "docs" / "plugins.md").read_text(encoding="utf-8")
    rule = docs.split("**Public API only.**", 1)[1].split("\n- **", 1)[0]
    named = set(re.findall(r"`(soup_core(?:\.\w+)*)`", rule))
    assert "soup_core.__all__" in named and not is_module("soup_core.__all__")  # control: names are told apart
    assert {name for name in named if is_module(name)} == PUBLIC_MODULES
