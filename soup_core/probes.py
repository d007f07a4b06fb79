"""Helpers for writing capability probes (DESIGN.md §3).

Cheap helpers (:func:`distribution`, :func:`module_findable`, :func:`platform_is`) never import the library
they ask about. Deep helpers (:func:`accepts`, :func:`has_attribute`) ask the installed object itself —
a constructor's signature, an attribute — never a version number.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from soup_core.contracts import ProbeResult


def _normalise(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


_versions: dict[str, str] | None = None


def _installed_versions() -> dict[str, str]:
    """Normalised distribution name -> version, read from ``*.dist-info`` folder names on ``sys.path``
    (first one wins, as importlib.metadata does) — without importing importlib.metadata, whose start-up
    cost every command would pay through the cheap probes."""
    global _versions
    if _versions is None:
        found: dict[str, str] = {}
        for entry in sys.path:
            try:
                names = os.listdir(entry or ".")
            except OSError:
                continue
            for folder in names:
                if folder.endswith(".dist-info"):
                    dist, _, version = folder[: -len(".dist-info")].partition("-")
                    found.setdefault(_normalise(dist), version)
        _versions = found
    return _versions


def distribution_version(name: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    version = _installed_versions().get(_normalise(name))
    if version:
        return version
    import importlib.metadata  # egg-info and other layouts: ask the slow, thorough way

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def distribution(name: str, *, fix: str | None = None) -> ProbeResult:
    """Cheap: is the distribution ``name`` installed?"""
    version = distribution_version(name)
    if version is None:
        return ProbeResult(False, f"{name} is not installed", fix or f"pip install {name}")
    return ProbeResult(True, detail=f"{name} {version}")


def module_findable(module: str, *, fix: str | None = None) -> ProbeResult:
    """Cheap: can ``module`` be imported? Found through the import system without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return ProbeResult(False, f"module {module!r} cannot be found", fix or f"pip install {module}")
    return ProbeResult(True)


def platform_is(*platforms: str) -> ProbeResult:
    """Cheap: does ``sys.platform`` start with one of ``platforms`` (``linux``, ``darwin``, ``win``)?"""
    if any(sys.platform.startswith(p) for p in platforms):
        return ProbeResult(True, detail=sys.platform)
    return ProbeResult(False, f"needs {' or '.join(platforms)}, this is {sys.platform}")


def _init_parameters(cls: Any) -> set[str] | None:
    """Keyword names a class's constructor accepts, walking the MRO past ``*args, **kwargs`` shims."""
    import inspect

    for klass in getattr(cls, "__mro__", (cls,)):
        init = klass.__dict__.get("__init__") if isinstance(klass, type) else None
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters
        except (TypeError, ValueError):
            return None
        names = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        passthrough = any(p.kind == p.VAR_KEYWORD for p in params.values())
        if names - {"self"} or not passthrough:
            return names - {"self"}
    return None


def accepts(cls: Any, keyword: str) -> bool:
    """Deep: does ``cls(...)`` accept ``keyword``? Asks the installed class's signature (dataclass
    configs included), never its version."""
    names = _init_parameters(cls)
    return names is not None and keyword in names


def supported_kwargs(cls: Any, wanted: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``wanted`` that ``cls`` accepts."""
    names = _init_parameters(cls) or set()
    return {k: v for k, v in wanted.items() if k in names}


def has_attribute(obj: Any, dotted: str) -> bool:
    """Deep: does ``obj`` have the (possibly dotted) attribute ``dotted``?"""
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def run_probe(check: Callable[[], ProbeResult]) -> ProbeResult:
    """Run a probe; a probe that raises is a failed probe, not a crash."""
    try:
        result = check()
    except Exception as exc:  # noqa: BLE001 - a broken probe must not break the CLI
        return ProbeResult(False, f"probe raised {type(exc).__name__}: {exc}")
    if not isinstance(result, ProbeResult):
        return ProbeResult(False, f"probe returned {type(result).__name__}, not ProbeResult")
    return result
