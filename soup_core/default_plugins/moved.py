"""Module names the core had before its built-ins became default plugins, still importable for the whole 0.x
line: ``from soup_core import tiny`` or ``import soup_core.backends.transformers.trainer`` gives the module that
now holds that code (the same module object, so its classes are the same classes), with one
``DeprecationWarning`` per old name and process naming the new one (docs/plugins.md, "Migration").

:func:`install` (called by ``import soup_core``) puts :class:`MovedModules` first on ``sys.meta_path``: it
answers only for the names in :data:`MOVED` and imports nothing until one of them is imported.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
import warnings
from pathlib import Path
from typing import Any

_TF = "soup_core.default_plugins.transformers"
_CMD = "soup_core.default_plugins.commands"

#: old module -> the module that holds its code now
MOVED: dict[str, str] = {
    "soup_core.backends": "soup_core.default_plugins",
    "soup_core.backends.transformers": _TF,
    **{f"soup_core.backends.transformers.{m}": f"{_TF}.{m}"
       for m in ("backend", "loading", "plugin", "progress", "trainer")},
    "soup_core.tiny": f"{_TF}.tiny",
    "soup_core.tasks": "soup_core.default_plugins.sft",
    "soup_core.tasks.sft": "soup_core.default_plugins.sft",
    "soup_core.tasks.plugin": "soup_core.default_plugins.sft",
    "soup_core.data.formats": "soup_core.default_plugins.formats",
    "soup_core.data.plugin": "soup_core.default_plugins.formats",
    "soup_core.tracker.recorder": "soup_core.default_plugins.tracker",
    "soup_core.tracker.plugin": "soup_core.default_plugins.tracker",
    "soup_core.doctor": f"{_CMD}.doctor",
    "soup_core.quickstart": f"{_CMD}.quickstart",
    "soup_core.distributed": f"{_CMD}.train_cmd",
    "soup_core.cli.builtin": f"{_CMD}.plugin",
    **{f"soup_core.cli.{m}": f"{_CMD}.{m}"
       for m in ("doctor_cmd", "init_cmd", "merge_cmd", "plugins_cmd", "quickstart_cmd", "runs", "train_cmd")},
}
#: old packages whose new home is a module: a package of that name stands in, its attributes the module's
SHIMS = ("soup_core.backends", "soup_core.tasks")
_warned: set[str] = set()
_PACKAGE = str(Path(__file__).resolve().parents[1])


def warn_moved(old: str, new: str, what: str = "module") -> None:
    """One ``DeprecationWarning`` per ``old`` name and process."""
    if old in _warned:
        return
    _warned.add(old)
    # attributed to the first frame outside soup_core and the import machinery (which warnings skips by itself,
    # so it is not counted): the code that named it
    frame, level = sys._getframe(1), 2
    while frame is not None and (frame.f_code.co_filename.startswith(("<frozen", _PACKAGE))):
        level += not frame.f_code.co_filename.startswith("<frozen importlib._bootstrap")
        frame = frame.f_back
    warnings.warn(f"the {what} {old} is deprecated: import {new} instead; the old name works until soup-core 1.0",
                  DeprecationWarning, stacklevel=level)


class _Alias:  # an import loader (no importlib.abc base: import soup_core stays cheap)
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: Any) -> Any:
        warn_moved(spec.name, self.target)
        if spec.name in SHIMS:  # a package, so that its old submodules import too
            shim = types.ModuleType(spec.name, f"Deprecated: use {self.target}.")
            shim.__path__ = []  # type: ignore[attr-defined]
            shim.__getattr__ = lambda name: getattr(importlib.import_module(self.target), name)  # type: ignore
            self.spec = None
            return shim
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:  # the target module ran already; it keeps its own spec
        if self.spec is not None:
            module.__spec__ = self.spec


class MovedModules:  # a sys.meta_path finder
    """Finds the old module names of :data:`MOVED` (the new module under the old name)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = MOVED.get(fullname)
        if new is None and fullname.startswith("soup_core.backends.transformers."):  # a module added since
            new = f"{_TF}.{fullname.rsplit('.', 1)[1]}"
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), is_package=False)


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
