"""Helpers for writing capability probes (docs/plugins.md, "Capability probes").

Cheap helpers (:func:`distribution`, :func:`module_findable`, :func:`platform_is`) never import the library
they ask about. Deep helpers (:func:`accepts`, :func:`has_attribute`) ask the installed object itself —
a constructor's signature, an attribute — never a version number.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from soup_core import distributions
from soup_core.contracts import Probe, ProbeResult


def distribution_version(name: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    return distributions.version_of(name)


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


def _parameters(obj: Any) -> tuple[set[str], bool]:
    """The keyword names ``obj`` accepts, and whether it takes ``**kwargs`` as well. A class answers for its
    constructor, walking the MRO past ``*args, **kwargs`` shims (dataclass configs included); a function or
    method for itself."""
    import inspect

    if isinstance(obj, type):
        inits = [k.__dict__["__init__"] for k in obj.__mro__ if "__init__" in k.__dict__]
    elif callable(obj) and (inspect.isroutine(obj) or isinstance(obj, functools.partial)):
        inits = [obj]
    else:
        raise TypeError(f"accepts() asks a class or a function, not {type(obj).__name__}")
    for init in inits:
        try:
            params = inspect.signature(init).parameters
        except (TypeError, ValueError):
            return set(), False
        names = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY)}
        var_keyword = any(p.kind == p.VAR_KEYWORD for p in params.values())
        if names - {"self", "cls"} or not var_keyword or len(inits) == 1:
            return names - {"self", "cls"}, var_keyword and not isinstance(obj, type)
    return set(), False


def accepts(obj: Any, *names: str) -> bool:
    """Deep: does ``obj`` accept every keyword in ``names``? ``obj`` is a class (asked about its
    constructor: ``accepts(GRPOConfig, "loss_type")``) or a function or method (``accepts(SFTTrainer.compute_loss,
    "num_items_in_batch")``; one that takes ``**kwargs`` accepts any name). Asks the installed object's
    signature, never its version; anything else raises ``TypeError``."""
    known, anything = _parameters(obj)
    return anything or all(name in known for name in names)


def supported_kwargs(cls: Any, wanted: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``wanted`` that ``cls`` accepts."""
    known, anything = _parameters(cls)
    return {k: v for k, v in wanted.items() if anything or k in known}


def has_attribute(obj: Any, dotted: str) -> bool:
    """Deep: does ``obj`` have the (possibly dotted) attribute ``dotted``?"""
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def installation_key() -> str:
    """A hash of this installation: this Python and every distribution on ``sys.path``, at its version and
    place. A verdict kept under it (a deep probe's, a base model's check) is asked afresh after any install."""
    import hashlib

    install = repr([sys.version, sys.executable, sorted(distributions.installed().values())])
    return hashlib.sha256(install.encode()).hexdigest()


def run_deep_probe(plugin: str, probe: Probe) -> ProbeResult:
    """A deep probe's verdict before a run. A pass is kept under ``$SOUP_HOME/cache/probes.json`` for this
    installation: every distribution on ``sys.path`` at the same version and place, this Python, and the
    probe's source file unchanged; so a run does not import a library only to ask it what it already
    answered. Failures are never kept, and ``soup plugins list --check`` always asks afresh."""
    import json

    from soup_core.io import atomic_write, read_json_object
    from soup_core.tracker.store import soup_home

    code = getattr(probe.check, "__code__", None)
    try:
        stamp = os.stat(code.co_filename) if code else None
        source = [code.co_filename, code.co_firstlineno, stamp.st_mtime_ns, stamp.st_size] if stamp else None
    except OSError:
        source = None
    env = installation_key()
    key = json.dumps([plugin, probe.name, probe.scope, source])
    path = soup_home() / "cache" / "probes.json"
    cached = read_json_object(path) or {}
    passed = cached.get("passed") if cached.get("env") == env and isinstance(cached.get("passed"), dict) else {}
    if source is not None and key in passed:
        return ProbeResult(True, detail=str(passed[key]))
    result = run_probe(probe.check)
    if result.ok and source is not None:
        passed[key] = result.detail
        with contextlib.suppress(OSError):  # a cache that cannot be written only costs the next run time
            atomic_write(path, json.dumps({"env": env, "passed": passed}, indent=1))
    return result


def run_probe(check: Callable[[], ProbeResult]) -> ProbeResult:
    """Run a probe; a probe that raises is a failed probe, not a crash."""
    try:
        result = check()
    except Exception as exc:  # noqa: BLE001 - a broken probe must not break the CLI
        return ProbeResult(False, f"probe raised {type(exc).__name__}: {exc}")
    if not isinstance(result, ProbeResult):
        return ProbeResult(False, f"probe returned {type(result).__name__}, not ProbeResult")
    return result
