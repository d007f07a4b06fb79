"""A testing kit for plugin authors (and for Soup's own tests).

- :func:`isolated_plugins` builds a plugin set with the built-ins and the plugin objects you pass, without
  reading the installed entry points, so a test sees exactly the plugins it names.
- :func:`registered_plugin` makes ``soup_core.load_plugins()`` (and so the CLI) include a plugin object
  for the duration of a ``with`` block.
- :func:`make_distribution` lays out a real installed distribution (``.dist-info`` with ``METADATA`` and
  ``entry_points.txt``, plus its modules) in a folder, as pip would in site-packages, so entry-point
  discovery can be tested for real: put the folder on ``sys.path`` (or ``PYTHONPATH`` for a subprocess).
- :func:`run_soup` runs the ``soup`` CLI in a fresh subprocess.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from soup_core.plugins import manager
from soup_core.plugins.manager import PluginSet, build_plugin_set


def isolated_plugins(
    *plugins: tuple[str, Any], builtins: bool = True, entry_points: bool = False, strict: bool = False
) -> PluginSet:
    """A fresh plugin set: the built-ins (unless ``builtins=False``) plus ``(name, plugin)`` pairs."""
    return build_plugin_set(extra=list(plugins), builtins=builtins, entry_points=entry_points, strict=strict)


@contextlib.contextmanager
def registered_plugin(name: str, plugin: Any, *, entry_points: bool = False) -> Iterator[PluginSet]:
    """Within the block, ``load_plugins()`` returns a set that includes ``plugin`` under ``name``."""
    saved = dict(manager._cache)
    plugin_set = build_plugin_set(extra=[(name, plugin)], entry_points=entry_points)
    manager._cache.clear()
    original = manager.load_plugins

    def _load(env: Mapping[str, str] | None = None, *, refresh: bool = False) -> PluginSet:
        return plugin_set

    manager.load_plugins = _load  # type: ignore[assignment]
    import soup_core.plugins as plugins_pkg

    plugins_pkg.load_plugins = _load  # type: ignore[assignment]
    try:
        yield plugin_set
    finally:
        manager.load_plugins = original  # type: ignore[assignment]
        plugins_pkg.load_plugins = original  # type: ignore[assignment]
        manager._cache.clear()
        manager._cache.update(saved)


def make_distribution(
    site_dir: str | os.PathLike[str],
    name: str,
    *,
    version: str = "0.1.0",
    entry_points: Mapping[str, str] | None = None,
    modules: Mapping[str, str] | None = None,
    requires: Sequence[str] = (),
) -> Path:
    """Write an installed distribution into ``site_dir``: its modules (relative path → source) and a
    ``NAME-VERSION.dist-info`` whose ``entry_points.txt`` lists ``entry_points`` (plugin name →
    module) in the ``soup`` group. Returns the dist-info folder."""
    site = Path(site_dir)
    site.mkdir(parents=True, exist_ok=True)
    for rel, source in (modules or {}).items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    normalized = name.replace("-", "_")
    info = site / f"{normalized}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata += [f"Requires-Dist: {req}" for req in requires]
    (info / "METADATA").write_text("\n".join(metadata) + "\n", encoding="utf-8")
    if entry_points:
        lines = ["[soup]"] + [f"{ep} = {target}" for ep, target in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (info / "RECORD").write_text("", encoding="utf-8")
    return info


def run_soup(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    extra_path: Sequence[str | os.PathLike[str]] = (),
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``soup ARGS`` in a fresh interpreter (``python -m soup_core``); ``extra_path`` is prepended
    to ``PYTHONPATH`` (for distributions made with :func:`make_distribution`)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    paths = [str(p) for p in extra_path]
    if full_env.get("PYTHONPATH"):
        paths.append(full_env["PYTHONPATH"])
    repo_root = Path(__file__).resolve().parent.parent
    if (repo_root / "pyproject.toml").exists():  # a source checkout, not an installed wheel
        paths.append(str(repo_root))
    full_env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run(
        [sys.executable, "-m", "soup_core", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )
