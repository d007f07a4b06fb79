"""The one scanner of installed distributions, shared by the plugin manager, the probes and ``soup doctor``.

Entry points, names, versions and declared requirements come from ``importlib.metadata``; version ranges,
requirement lines and markers are read by ``packaging`` (the code pip itself uses), imported only where a
range or a marker is checked, so ``soup --help`` never pays for it.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

ENTRY_POINT_GROUP = "soup"


def canonical(name: str) -> str:
    """A project name as PEP 503 compares them (``Soup_Plugin.X`` -> ``soup-plugin-x``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def soup_entry_points() -> list[metadata.EntryPoint]:
    """Entry points of the ``soup`` group, by name; for a distribution installed twice, the first on
    ``sys.path`` (as imports resolve it)."""
    return sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def distributions(path: Sequence[str] | None = None, name: str | None = None) -> Iterator[metadata.Distribution]:
    """Installed distributions on ``path`` (default ``sys.path``), only those called ``name`` if given."""
    kwargs: dict[str, Any] = {"path": list(path) if path is not None else sys.path}
    if name is not None:
        kwargs["name"] = name
    return iter(metadata.distributions(**kwargs))


def version_of(name: str, path: Sequence[str] | None = None) -> str | None:
    """The installed version of distribution ``name``, or None when it is not installed."""
    dist = next(distributions(path, name), None)
    return None if dist is None else str(dist.version)


def requirement(line: str) -> Any:
    """A ``Requires-Dist`` line as a ``packaging.requirements.Requirement``."""
    from packaging.requirements import Requirement

    return Requirement(line)


def in_range(specifier: str, version: str) -> bool:
    """Whether an installed ``version`` satisfies ``specifier`` (pre-releases count: this asks about what
    is installed, not what to install). A version ``packaging`` cannot read satisfies nothing."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def marker_holds(marker: Any, extra: str = "") -> bool:
    """Whether a requirement's marker (a ``packaging`` marker, a string, or None) holds here when ``extra``
    is requested ("" for none)."""
    if not marker:
        return True
    from packaging.markers import Marker

    return bool((marker if isinstance(marker, Marker) else Marker(str(marker))).evaluate({"extra": extra}))


def declared_range(dist: metadata.Distribution, project: str) -> str:
    """The version range ``dist`` declares for ``project`` in its plain requirements ("" when none; lines
    under an extra or a marker that does not hold here do not count)."""
    for line in dist.requires or ():
        req = requirement(line)
        if canonical(req.name) == canonical(project) and marker_holds(req.marker):
            return str(req.specifier)
    return ""
