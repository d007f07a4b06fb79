"""The one scanner of installed distributions, shared by the plugin manager, the probes and ``soup doctor``.

Which distributions are installed, at which version, and their ``soup`` entry points are read the way
``importlib.metadata`` finds them (``*.dist-info`` folders on ``sys.path``, the first of a name wins), from
the folder names the wheel standard fixes (``name-version.dist-info``) and ``entry_points.txt`` (an INI file,
read by ``configparser``): importing ``importlib.metadata`` and its e-mail parser would cost every ``soup``
start a third of its time. ``Requires-Dist`` lines are read from ``METADATA``'s headers directly (every
command checks each plugin's soup-core range); what else only ``METADATA`` holds (extras) comes from
``importlib.metadata``; version ranges, requirement lines and markers are read by ``packaging``, the code pip
itself uses. Both are imported only where they are needed, never by ``soup --help``.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

ENTRY_POINT_GROUP = "soup"


def canonical(name: str) -> str:
    """A project name as PEP 503 compares them (``Soup_Plugin.X`` -> ``soup-plugin-x``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


class Installed(NamedTuple):
    """One installed distribution: its name (PEP 503 form), version and ``.dist-info`` folder."""

    name: str
    version: str
    path: str

    def metadata(self) -> Any:
        """This distribution through ``importlib.metadata`` (for what only ``METADATA`` holds)."""
        from importlib.metadata import PathDistribution
        from pathlib import Path

        return PathDistribution(Path(self.path))


class EntryPoint(NamedTuple):
    """A ``soup`` entry point: plugin name, ``module[:attr]`` target, and the distribution declaring it."""

    name: str
    value: str
    dist: Installed

    def load(self) -> Any:
        module, _, attr = self.value.partition("[")[0].strip().partition(":")
        obj = importlib.import_module(module.strip())
        for part in filter(None, attr.strip().split(".")):
            obj = getattr(obj, part)
        return obj


_seen: dict[tuple[tuple[str, float], ...], dict[str, Installed]] = {}
#: names (PEP 503) of the ``.egg-info`` / ``.egg`` distributions on the path ``_seen`` was read from
_eggs: set[str] = set()


def installed(path: Sequence[str] | None = None) -> dict[str, Installed]:
    """Every ``*.dist-info`` distribution on ``path`` (default ``sys.path``) by PEP 503 name, the first of
    each name winning, as imports resolve it. Kept while no folder of the path changes (an install or an
    uninstall changes its folder's modification time)."""
    entries = list(sys.path if path is None else path)
    key = tuple((entry, _mtime(entry)) for entry in entries)
    if key not in _seen:
        found: dict[str, Installed] = {}
        eggs: set[str] = set()
        for entry in entries:
            try:
                folders = os.listdir(entry or ".")
            except OSError:
                continue
            for folder in folders:
                if folder.endswith(".dist-info"):
                    name, _, version = folder[: -len(".dist-info")].partition("-")
                    found.setdefault(canonical(name), Installed(canonical(name), version, os.path.join(entry, folder)))
                elif folder.endswith((".egg-info", ".egg")):
                    eggs.add(canonical(folder.partition("-")[0].rsplit(".egg", 1)[0]))
        _seen.clear()
        _seen[key] = found
        _eggs.clear()
        _eggs.update(eggs)
    return _seen[key]


def _mtime(entry: str) -> float:
    try:
        return os.stat(entry or ".").st_mtime
    except OSError:
        return -1.0


def soup_entry_points(path: Sequence[str] | None = None) -> list[EntryPoint]:
    """Entry points of the ``soup`` group of every installed distribution, by name. ``entry_points.txt`` is
    read as the entry-point specification describes it: ``[group]`` lines, then ``name = value`` lines."""
    found: list[EntryPoint] = []
    for dist in installed(path).values():
        try:
            with open(os.path.join(dist.path, "entry_points.txt"), encoding="utf-8") as handle:
                lines = [line.strip() for line in handle]
        except OSError:
            continue
        group = None
        for line in lines:
            if line.startswith("[") and line.endswith("]"):
                group = line[1:-1].strip()
            elif group == ENTRY_POINT_GROUP and "=" in line and not line.startswith(("#", ";")):
                name, _, value = line.partition("=")
                found.append(EntryPoint(name.strip(), value.strip(), dist))
    return sorted(found, key=lambda ep: ep.name)


def distributions(path: Sequence[str] | None = None, name: str | None = None) -> Iterator[Any]:
    """Installed distributions on ``path`` as ``importlib.metadata`` objects (``.dist-info`` and
    ``.egg-info`` both), only those called ``name`` if given."""
    import importlib.metadata

    kwargs: dict[str, Any] = {"path": list(path) if path is not None else sys.path}
    if name is not None:
        kwargs["name"] = name
    return iter(importlib.metadata.distributions(**kwargs))


def version_of(name: str, path: Sequence[str] | None = None) -> str | None:
    """The installed version of distribution ``name``, or None when it is not installed."""
    dist = installed(path).get(canonical(name))
    if dist is not None:
        return dist.version
    if canonical(name) not in _eggs:  # asking importlib.metadata about a name that is nowhere costs ~20 ms
        return None
    found = next(distributions(path, name), None)  # an .egg-info: its version is in its metadata
    return None if found is None else str(found.version)


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


def requires(dist: Installed) -> list[str]:
    """The ``Requires-Dist`` lines of ``dist``, as ``importlib.metadata``'s ``requires`` gives them for a
    ``.dist-info``: its ``METADATA`` headers (up to the first blank line, a folded line joined to the one
    before), read without the e-mail parser that every plugin's range check would otherwise import."""
    try:
        with open(os.path.join(dist.path, "METADATA"), encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError):
        return list(dist.metadata().requires or ())
    headers: list[list[str]] = []
    for line in text.splitlines():
        if line[:1] in (" ", "\t") and headers:  # folded, even when only blanks are left on it
            headers[-1][1] += line
        elif ":" not in line:  # the blank line (or a body with none) after the headers
            break
        else:
            name, _, value = line.partition(":")
            headers.append([name.strip().lower(), value.strip()])
    return [value.strip() for name, value in headers if name == "requires-dist"]


def declared_range(dist: Installed, project: str) -> str:
    """The version range ``dist`` declares for ``project`` in its plain requirements ("" when none; lines
    under an extra or a marker that does not hold here do not count)."""
    for line in requires(dist):
        named = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if named and canonical(named.group(1)) != canonical(project):
            continue  # another project's line: not parsed, so a command that checks ranges imports no packaging
        req = requirement(line)
        if canonical(req.name) == canonical(project) and marker_holds(req.marker):
            return str(req.specifier)
    return ""
