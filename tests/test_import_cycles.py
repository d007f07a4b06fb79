"""No import cycle in any package of the repo: the core and every plugin's ``src/<package>``.

The scan is static (it parses the files, imports none of them) and counts every import statement,
module-level or inside a function: a cycle closed through a deferred import is still a cycle in the
design, only one that happens not to fail at import time. Imports under ``if TYPE_CHECKING:`` do not
count. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` itself
(its ``__init__``); relative imports resolve against the importing module. Cycles are looked for in one
graph of all packages, so one that runs through two packages is found too.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXPECTED = {
    "soup_core",
    "soup_plugin_streaming",
    "soup_plugin_mlx",
    "soup_plugin_rl",
    "soup_plugin_rewind",
    "soup_plugin_unlearn",
    "soup_plugin_distill",
    "soup_plugin_example",
}


def package_roots(repo: Path = REPO) -> dict[str, Path]:
    """Package name -> its folder: the core, then each plugin's ``src/<package>`` (top-level or under
    ``plugins/``)."""
    inits = [*repo.glob("soup_plugin_*/src/*/__init__.py"), *repo.glob("plugins/*/src/*/__init__.py")]
    roots = [repo / "soup_core", *(init.parent for init in inits)]
    return {root.name: root for root in sorted(roots)}


def module_files(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is it a package's ``__init__``) for every ``.py`` under ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            children: list[ast.AST] = list(child.orelse)  # the body only runs for a type checker
        else:
            children = [child]
        for item in children:
            if isinstance(item, (ast.Import, ast.ImportFrom)):
                yield item
            yield from _imports(item)


def _known_prefix(name: str, modules: Mapping[str, object]) -> str | None:
    """``name`` or its longest prefix that is a scanned module (None: outside every scanned package)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imported_by(name: str, path: Path, is_package: bool, modules: Mapping[str, object]) -> set[str]:
    """The scanned modules that module ``name`` (file ``path``) imports."""
    targets: set[str | None] = set()
    for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(_known_prefix(alias.name, modules) for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            package = name.split(".") if is_package else name.split(".")[:-1]
            anchor = package[: len(package) - node.level + 1]
            base = ".".join([*anchor, *([node.module] if node.module else [])])
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            targets.add(submodule if submodule in modules else _known_prefix(base, modules))
    return {t for t in targets if t is not None and t != name}


def import_graph(roots: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module -> the scanned modules it imports, over all the packages in ``roots``."""
    modules: dict[str, tuple[Path, bool]] = {}
    for root in roots.values():
        modules.update(module_files(root))
    return {name: imported_by(name, path, is_package, modules) for name, (path, is_package) in modules.items()}


def _shortest_path(graph: Mapping[str, set[str]], start: str, goal: str) -> list[str] | None:
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = [node]
            while came_from[path[-1]] is not None:
                path.append(came_from[path[-1]])  # type: ignore[arg-type]
            return path[::-1]
        for nxt in sorted(graph.get(node, ())):
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    return None


def cycles(graph: Mapping[str, set[str]]) -> list[str]:
    """Every import edge that lies on a cycle, each shown by the shortest cycle through it as
    ``a -> b -> c -> a`` (rotated to start at its smallest module; duplicates dropped)."""
    found = set()
    for source in sorted(graph):
        for target in sorted(graph[source]):
            back = _shortest_path(graph, target, source)
            if back is None:
                continue
            loop = [source, *back[:-1]]
            first = loop.index(min(loop))
            loop = loop[first:] + loop[:first]
            found.add(" -> ".join([*loop, loop[0]]))
    return sorted(found)


@pytest.fixture(scope="module")
def repo_cycles() -> list[str]:
    return cycles(import_graph(package_roots()))


def test_every_package_is_scanned() -> None:
    roots = package_roots()
    assert EXPECTED <= set(roots), f"packages not found: {sorted(EXPECTED - set(roots))}"


@pytest.mark.parametrize("package", sorted(EXPECTED))
def test_no_import_cycle(package: str, repo_cycles: list[str]) -> None:
    mine = [c for c in repo_cycles if any(m.split(".")[0] == package for m in c.split(" -> "))]
    if mine:
        pytest.fail(f"import cycles through {package}:\n  " + "\n  ".join(mine), pytrace=False)


# -------------------------------------------------------------------------------------------- controls


def _write_package(tmp_path: Path, files: Mapping[str, str]) -> Path:
    root = tmp_path / "src" / "pkg"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _tiny_package(tmp_path: Path, *, broken: bool) -> Path:
    """``pkg.a`` imports ``pkg.b``, which imports ``pkg.sub.c``; ``pkg.sub.c`` imports ``pkg.a`` only
    inside a function (the cycle), or, when ``broken``, a name from ``pkg.errors`` instead."""
    deferred = "    from pkg.errors import Failure\n" if broken else "    from ..a import helper\n"
    return _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "errors.py": "class Failure(Exception):\n    pass\n",
            "a.py": "from pkg import b\n\n\ndef helper():\n    return b\n",
            "b.py": "from .sub.c import run\n",
            "sub/__init__.py": "",
            "sub/c.py": (
                "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.a import helper\n\n\n"
                f"def run():\n{deferred}    return 1\n"
            ),
        },
    )


def test_control_a_cycle_through_a_deferred_import_is_reported(tmp_path: Path) -> None:
    graph = import_graph({"pkg": _tiny_package(tmp_path, broken=False)})
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"}
    assert cycles(graph) == ["pkg.a -> pkg.b -> pkg.sub.c -> pkg.a"]


def test_control_the_same_package_with_the_cycle_broken_is_clean(tmp_path: Path) -> None:
    graph = import_graph({"pkg": _tiny_package(tmp_path, broken=True)})
    assert graph["pkg.sub.c"] == {"pkg.errors"}  # the TYPE_CHECKING import of pkg.a does not count
    assert cycles(graph) == []


def test_control_a_name_from_a_package_is_an_edge_to_its_init(tmp_path: Path) -> None:
    root = _write_package(
        tmp_path,
        {
            "__init__.py": "from pkg.core import VALUE\n",
            "core.py": "VALUE = 1\n",
            "user.py": "def f():\n    from pkg import VALUE, core\n    import pkg.core\n    return VALUE\n",
            "late.py": "import typing\n\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from . import user\n",
        },
    )
    graph = import_graph({"pkg": root})
    assert graph["pkg.user"] == {"pkg", "pkg.core"}
    assert graph["pkg.late"] == {"pkg.user"}  # the else branch of a TYPE_CHECKING test runs
    assert cycles(graph) == []
    (root / "core.py").write_text("VALUE = 1\n\n\ndef g():\n    from . import user\n")
    assert cycles(import_graph({"pkg": root})) == [
        "pkg -> pkg.core -> pkg.user -> pkg",
        "pkg.core -> pkg.user -> pkg.core",
    ]
