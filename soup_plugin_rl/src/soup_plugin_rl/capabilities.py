"""Capability probes: which trl classes the installed trl has, where, and what they accept.

Every answer comes from the installed objects — a class found by import, a constructor's signature, a
loss type named in the trainer's own source — never from comparing version numbers. The helpers take
the classes (or module names) as arguments so a test can hand them a fake class with or without a
keyword and see the answer follow the class.

Import-light: trl is imported only inside the functions.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from soup_core import probes
from soup_core.contracts import ProbeResult
from soup_plugin_rl.errors import CapabilityError

INSTALL_FIX = "pip install 'soup-core[train]' (or upgrade trl: pip install -U trl)"


class TrlPair(NamedTuple):
    """A trainer and its config class, and the modules to look in, in order (trl moves classes from
    ``trl`` to ``trl.experimental.<algo>`` and back)."""

    trainer: str
    config: str
    modules: tuple[str, ...]


class TaskNeeds(NamedTuple):
    """What a task needs from trl: the classes, the config keywords it must be able to set (with the
    value it sets), and the loss-type literal the trainer's loss code must handle (None: any). Each task
    declares its own as its ``trl_needs`` class attribute (:mod:`soup_plugin_rl.tasks`)."""

    pair: TrlPair
    required: Mapping[str, Any]
    loss_literal: str | None = None


# ------------------------------------------------------------------------------------------ finding


def find_class(name: str, modules: Sequence[str]) -> tuple[Any, str]:
    """The class ``name`` from the first of ``modules`` that has it, and that module's name.

    Raises :class:`CapabilityError` naming every place looked in and why each failed.
    """
    tried: list[str] = []
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            tried.append(f"{module_name} (not importable: {exc})")
            continue
        try:
            obj = getattr(module, name)
        except Exception as exc:  # noqa: BLE001 - trl's lazy module raises its own errors on a missing name
            tried.append(f"{module_name}.{name} (absent: {type(exc).__name__})")
            continue
        if isinstance(obj, type):
            return obj, module_name
        tried.append(f"{module_name}.{name} (not a class)")
    raise CapabilityError(f"no {name} in the installed trl{_trl_version()}; looked for " + "; ".join(tried))


def find_pair(pair: TrlPair) -> tuple[Any, Any]:
    """(trainer class, config class) for ``pair``."""
    trainer, _ = find_class(pair.trainer, pair.modules)
    config, _ = find_class(pair.config, pair.modules)
    return trainer, config


def _trl_version() -> str:
    version = probes.distribution_version("trl")
    return f" ({version})" if version else ""


# ---------------------------------------------------------------------------------------- asking


def field_default(config_cls: Any, keyword: str) -> Any:
    """The declared default of a dataclass config's field (``dataclasses.MISSING`` when unknown)."""
    fields = getattr(config_cls, "__dataclass_fields__", {})
    f = fields.get(keyword)
    if f is None:
        return dataclasses.MISSING
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def loss_type_value(config_cls: Any, name: str) -> Any:
    """``name`` in the shape the config's ``loss_type`` takes: a list where the field defaults to a list
    (trl's DPOConfig combines several losses), else the plain string."""
    return [name] if isinstance(field_default(config_cls, "loss_type"), list) else name


def source_of(cls: Any) -> str | None:
    """The source text of the modules that define ``cls`` and its trl base classes (None when none can be
    read). Whole module files, read once each: parsing a class out of its module takes seconds."""
    texts = []
    for klass in getattr(cls, "__mro__", (cls,)):
        if klass is not cls and not getattr(klass, "__module__", "").startswith("trl"):
            continue
        try:
            path = inspect.getsourcefile(klass)
        except TypeError:
            path = None
        text = _read_source(path) if path else None
        if text is not None:
            texts.append(text)
    return "\n".join(texts) if texts else None


@functools.lru_cache(maxsize=64)
def _read_source(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError:
        return None


def handles_literal(cls: Any, literal: str) -> bool | None:
    """Whether the trainer's source names the string ``literal`` (a loss-type name): True/False, or None when
    its source cannot be read (then trl itself refuses an unknown value at run time)."""
    text = source_of(cls)
    if text is None:
        return None
    return re.search(r"""(["'])""" + re.escape(literal) + r"\1", text) is not None


def check_needs(needs: TaskNeeds, trainer_cls: Any, config_cls: Any) -> ProbeResult:
    """Does (``trainer_cls``, ``config_cls``) offer what ``needs`` asks? The answer follows the classes."""
    missing = [k for k in needs.required if not probes.accepts(config_cls, k)]
    if missing:
        return ProbeResult(
            False,
            f"{config_cls.__name__} of the installed trl{_trl_version()} does not accept "
            + ", ".join(missing),
            INSTALL_FIX,
        )
    if needs.loss_literal is not None and handles_literal(trainer_cls, needs.loss_literal) is False:
        return ProbeResult(
            False,
            f"{trainer_cls.__name__} of the installed trl{_trl_version()} has no loss type "
            f"{needs.loss_literal!r}",
            INSTALL_FIX,
        )
    return ProbeResult(True, detail=f"{trainer_cls.__module__}.{trainer_cls.__name__}")


def probe_needs(
    name: str, needs: TaskNeeds, describe: Callable[[Any, Any], str] | None = None
) -> ProbeResult:
    """The deep probe of task ``name``: find its trl classes and check they offer what ``needs`` asks.
    ``describe(trainer class, config class)`` gives the detail of a success (default: where the trainer
    is)."""
    try:
        trainer_cls, config_cls = find_pair(needs.pair)
    except CapabilityError as exc:
        return ProbeResult(False, str(exc), INSTALL_FIX)
    result = check_needs(needs, trainer_cls, config_cls)
    if not result.ok:
        return result
    detail = describe(trainer_cls, config_cls) if describe else f"{name}: {result.detail}"
    return ProbeResult(True, detail=detail)
