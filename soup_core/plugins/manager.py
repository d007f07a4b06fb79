"""Finds, selects, loads and registers plugins (DESIGN.md §2, §3).

Built-in parts register through the same hooks as any plugin. Each entry point of the group ``soup`` is
loaded on its own: one that fails to import, declares an unsupported hook-API range, raises while
registering, or registers a name another plugin already holds is recorded as *failed* and skipped, and
the rest load. ``SOUP_STRICT_PLUGINS=1`` turns any such failure into an error.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from soup_core import hookspecs
from soup_core.contracts import Command, ConfigField, Probe, ProbeResult, Support
from soup_core.hookspecs import HOOK_API_VERSION, PROJECT
from soup_core.plugins.registry import DuplicateNameError, Registry
from soup_core.probes import run_probe

ENTRY_POINT_GROUP = "soup"

#: Built-in parts: (plugin name, module). They always load and cannot be disabled.
BUILTINS: tuple[tuple[str, str], ...] = (
    ("core.cli", "soup_core.cli.builtin"),
    ("core.tracker", "soup_core.tracker.plugin"),
    ("core.formats", "soup_core.data.plugin"),
    ("core.sft", "soup_core.tasks.plugin"),
    ("core.transformers", "soup_core.backends.transformers.plugin"),
)

OK, UNAVAILABLE, FAILED, DISABLED = "ok", "unavailable", "failed", "disabled"

# registration hook -> (registry attribute, how to name an item, kind shown to users)
_REGISTRATIONS: tuple[tuple[str, str, Callable[[Any], str], str], ...] = (
    ("soup_register_backends", "backends", lambda c: c.name, "backend"),
    ("soup_register_tasks", "tasks", lambda c: c.name, "task"),
    ("soup_register_data_formats", "data_formats", lambda f: f.name, "data format"),
    ("soup_register_recorders", "recorders", lambda c: c.name, "recorder"),
    ("soup_register_controllers", "controllers", lambda c: c.name, "controller"),
    ("soup_register_commands", "commands", lambda c: c.name, "command"),
    ("soup_register_config_fields", "config_fields", lambda f: f.path, "config field"),
)


class PluginLoadError(RuntimeError):
    """A plugin failed to load under ``SOUP_STRICT_PLUGINS=1``, or the selection names no plugin."""


class PluginSelectionError(PluginLoadError):
    """``SOUP_LOAD_PLUGINS`` / ``SOUP_DISABLE_PLUGINS`` / ``-p no:NAME`` names no installed plugin."""


@dataclass
class PluginInfo:
    """What ``soup plugins list`` shows about one plugin."""

    name: str
    builtin: bool
    distribution: str
    version: str
    status: str = OK
    reason: str = ""
    fix: str = ""
    hook_api: tuple[int, int] | None = None
    provides: dict[str, list[str]] = field(default_factory=dict)
    probes: list[Probe] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "builtin": self.builtin,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "reason": self.reason or None,
            "fix": self.fix or None,
            "hook_api": list(self.hook_api) if self.hook_api else None,
            "provides": self.provides,
            "details": self.details,
        }


@dataclass
class _Candidate:
    name: str
    builtin: bool
    distribution: str
    version: str
    load: Callable[[], Any]
    #: the soup-core range the plugin's distribution declares (``Requires-Dist``), e.g. ">=0.1,<0.2"
    core_range: str = ""


class PluginSet:
    """Everything the loaded plugins registered, and what happened to each plugin."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.backends: Registry[type] = Registry("backend")
        self.tasks: Registry[type] = Registry("task")
        self.data_formats: Registry[Any] = Registry("data format")
        self.recorders: Registry[type] = Registry("recorder")
        self.controllers: Registry[type] = Registry("controller")
        self.commands: Registry[Command] = Registry("command")
        self.config_fields: Registry[ConfigField] = Registry("config field")
        self._pair_support: dict[tuple[str, str], frozenset[str]] = {}
        self._capability_support: list[Support] = []
        #: (backend, task) -> field path -> why that pair leaves the field out
        self.support_reasons: dict[tuple[str, str], dict[str, str]] = {}
        #: probes that failed for one scope ("task:ppo", "backend:mlx") -> (plugin, result)
        self.unavailable_scopes: dict[str, tuple[str, ProbeResult]] = {}
        self.failures: list[str] = []

    # ------------------------------------------------------------------------------------ queries
    @property
    def support(self) -> dict[tuple[str, str], frozenset[str]]:
        """(backend, task) -> the fields that pair honours: each pair's own rows, plus the capability
        rows (``task="*"``) whose capability the task declares."""
        table = dict(self._pair_support)
        for row in self._capability_support:
            for backend, task in table:
                cls = self.tasks.get(task)
                if backend == row.backend and row.capability in (getattr(cls, "capabilities", ()) or ()):
                    table[(backend, task)] = table[(backend, task)] | frozenset(row.fields)
        return table

    def owner_of(self, kind: str, name: str) -> str:
        return getattr(self, kind).owner(name)

    def ok_plugins(self) -> list[str]:
        return [p.name for p in self.plugins.values() if p.status in (OK, UNAVAILABLE)]

    def call_load_model(self, **kwargs: Any) -> tuple[Any, str]:
        """Call ``soup_load_model`` as a firstresult hook; returns (result, plugin that answered).

        Implementations are tried in pluggy's order; the first non-None answer wins. A raising
        implementation stops the run with the plugin named.
        """
        hook = self.pm.hook.soup_load_model
        trace = os.environ.get("SOUP_TRACE_HOOKS") == "1"
        for impl in reversed(hook.get_hookimpls()):
            args = {k: kwargs[k] for k in impl.argnames if k in kwargs}
            try:
                result = impl.function(**args)
            except Exception as exc:
                raise RuntimeError(
                    f"plugin {impl.plugin_name!r} failed while loading the model: {type(exc).__name__}: {exc}"
                ) from exc
            if trace:
                verdict = "answered" if result is not None else "passed"
                print(f"[hook] soup_load_model: {impl.plugin_name} {verdict}", file=sys.stderr)
            if result is not None:
                return result, impl.plugin_name
        raise RuntimeError(f"no plugin could load a model for backend {kwargs.get('backend')!r}")

    def call_preflight(self, config: Any) -> list[tuple[str, Any]]:
        """Call every ``soup_preflight``; returns (plugin, report) for each non-None report."""
        reports = []
        for impl in reversed(self.pm.hook.soup_preflight.get_hookimpls()):
            try:
                report = impl.function(config=config)
            except Exception as exc:
                raise RuntimeError(
                    f"plugin {impl.plugin_name!r} failed in its pre-flight check: {type(exc).__name__}: {exc}"
                ) from exc
            if report is not None:
                reports.append((impl.plugin_name, report))
        return reports

    def requirements_for(self, *, backend: str, task: str, deep: bool = True) -> list[str]:
        """Reasons a run on (backend, task) cannot start: unavailable plugins or scopes, failed deep
        probes. Empty when the run may go ahead."""
        problems: list[str] = []
        for kind, name in (("backends", backend), ("tasks", task)):
            registry: Registry[Any] = getattr(self, kind)
            if name not in registry:
                continue
            plugin = self.plugins[registry.owner(name)]
            scope = f"{kind[:-1]}:{name}"
            if plugin.status == UNAVAILABLE:
                problems.append(f"{kind[:-1]} {name!r} (plugin {plugin.name!r}) is unavailable: "
                                f"{plugin.reason}" + (f" — fix: {plugin.fix}" if plugin.fix else ""))
                continue
            if scope in self.unavailable_scopes:
                _, result = self.unavailable_scopes[scope]
                problems.append(f"{kind[:-1]} {name!r} is unavailable: {result.reason}"
                                + (f" — fix: {result.fix}" if result.fix else ""))
                continue
            if deep:
                for probe in plugin.probes:
                    if probe.deep and probe.scope in (None, scope):
                        result = run_probe(probe.check)
                        if not result.ok:
                            problems.append(
                                f"{kind[:-1]} {name!r} (plugin {plugin.name!r}) failed probe {probe.name!r}: "
                                f"{result.reason}" + (f" — fix: {result.fix}" if result.fix else "")
                            )
        return problems

    def deep_check(self) -> dict[str, list[tuple[Probe, ProbeResult]]]:
        """Run every deep probe of every loaded plugin (``soup plugins list --check``)."""
        out: dict[str, list[tuple[Probe, ProbeResult]]] = {}
        for info in self.plugins.values():
            if info.status not in (OK, UNAVAILABLE):
                continue
            # a deep probe whose scope already failed its cheap probe would only repeat the failure, less clearly
            results = [(p, run_probe(p.check)) for p in info.probes
                       if p.deep and info.status == OK and p.scope not in self.unavailable_scopes]
            out[info.name] = results
            for probe, result in results:
                if result.ok:
                    if result.detail:
                        info.details.append(result.detail)
                    continue
                if probe.scope is None:
                    info.status, info.reason, info.fix = UNAVAILABLE, result.reason, result.fix
                else:
                    self.unavailable_scopes[probe.scope] = (info.name, result)
        return out

    # ------------------------------------------------------------------------------------ loading
    def _register(self, candidate: _Candidate) -> None:
        info = PluginInfo(candidate.name, candidate.builtin, candidate.distribution, candidate.version)
        self.plugins[candidate.name] = info
        if candidate.core_range and not _core_in_range(candidate.core_range):
            from soup_core import __version__

            # checked before importing: a plugin built for another core may not even import
            self._fail(info, f"its distribution requires soup-core{candidate.core_range}; this is soup-core "
                             f"{__version__}",
                       f"pip install --upgrade {candidate.distribution} (or pip install "
                       f"\"soup-core{candidate.core_range}\")")
            return
        try:
            module = candidate.load()
        except Exception as exc:  # noqa: BLE001 - any import failure is the plugin's, not ours
            self._fail(info, f"import failed: {type(exc).__name__}: {exc}",
                       f"pip install --force-reinstall {candidate.distribution}")
            return
        api = getattr(module, "SOUP_HOOK_API", None)
        if not (isinstance(api, tuple) and len(api) == 2 and all(isinstance(v, int) for v in api)):
            self._fail(info, "declares no SOUP_HOOK_API = (min, max) hook-API range",
                       "the plugin's author must declare the hook-API versions it supports")
            return
        info.hook_api = api
        if not api[0] <= HOOK_API_VERSION <= api[1]:
            self._fail(info, f"supports hook API {api[0]}..{api[1]}; this soup-core implements "
                             f"{HOOK_API_VERSION}",
                       f"pip install --upgrade {candidate.distribution} soup-core")
            return
        try:
            self.pm.register(module, name=candidate.name)
        except Exception as exc:  # pluggy.PluginValidationError and friends
            self._fail(info, f"invalid hook implementation: {exc}", "report this to the plugin's author")
            return
        try:
            staged = self._collect(candidate.name)
        except Exception as exc:  # noqa: BLE001
            self.pm.unregister(name=candidate.name)
            self._fail(info, f"raised while registering: {type(exc).__name__}: {exc}",
                       "report this to the plugin's author")
            return
        try:
            self._commit(candidate.name, staged, info)
        except DuplicateNameError as exc:
            self.pm.unregister(name=candidate.name)
            self._fail(info, str(exc), f"pip uninstall {candidate.distribution}, or soup -p no:{candidate.name}")
            return
        self._cheap_probes(info)

    def _collect(self, plugin: str) -> dict[str, list[Any]]:
        # registration hooks are called per plugin (not through pluggy's fan-out) so that a failure, or
        # a duplicate, is attributed to the one plugin that caused it
        trace = os.environ.get("SOUP_TRACE_HOOKS") == "1"
        staged: dict[str, list[Any]] = {}
        for hook_name in [h for h, *_ in _REGISTRATIONS] + ["soup_register_support", "soup_register_probes"]:
            items: list[Any] = []
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name == plugin:
                    items.extend(impl.function() or ())
                    if trace:
                        print(f"[hook] {hook_name}: {plugin} registered {len(items)}", file=sys.stderr)
            staged[hook_name] = items
        for row in staged["soup_register_support"]:
            if (row.task == "*") != bool(row.capability):
                raise ValueError(
                    f"support row ({row.backend}, {row.task}): a row for every task (task='*') needs a "
                    "capability, and only such a row may name one"
                )
        return staged

    def _commit(self, plugin: str, staged: dict[str, list[Any]], info: PluginInfo) -> None:
        # validate everything first so a refused plugin leaves no trace in the registries
        for hook_name, attr, name_of, kind in _REGISTRATIONS:
            registry: Registry[Any] = getattr(self, attr)
            seen: set[str] = set()
            for item in staged[hook_name]:
                name = name_of(item)
                if not name:
                    raise DuplicateNameError(kind, "<empty name>", plugin, plugin)
                if name in registry:
                    raise DuplicateNameError(kind, name, registry.owner(name), plugin)
                if name in seen:
                    raise DuplicateNameError(kind, name, plugin, plugin)
                seen.add(name)
        for hook_name, attr, name_of, _kind in _REGISTRATIONS:
            registry = getattr(self, attr)
            names = []
            for item in staged[hook_name]:
                registry.add(name_of(item), item, plugin)
                names.append(name_of(item))
            if names:
                info.provides[attr.replace("_", " ")] = names
        for row in staged["soup_register_support"]:
            if row.task == "*":
                self._capability_support.append(row)
                continue
            key = (row.backend, row.task)
            self._pair_support[key] = self._pair_support.get(key, frozenset()) | frozenset(row.fields)
            if row.reasons:
                self.support_reasons.setdefault(key, {}).update(row.reasons)
        info.probes = list(staged["soup_register_probes"])

    def _cheap_probes(self, info: PluginInfo) -> None:
        for probe in info.probes:
            if probe.deep:
                continue
            result = run_probe(probe.check)
            if result.ok:
                if result.detail:
                    info.details.append(result.detail)
                continue
            if probe.scope is None:
                if info.status == OK:
                    info.status, info.reason, info.fix = UNAVAILABLE, result.reason, result.fix
            else:
                self.unavailable_scopes[probe.scope] = (info.name, result)

    def _fail(self, info: PluginInfo, reason: str, fix: str) -> None:
        info.status, info.reason, info.fix = FAILED, reason, fix
        self.failures.append(f"plugin {info.name!r} ({info.distribution}): {reason}")


def _split(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def _load_target(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module.strip())
    for part in filter(None, attr.strip().split(".")):
        obj = getattr(obj, part)
    return obj


def _soup_section(text: str) -> list[tuple[str, str]]:
    """The ``[soup]`` entries of an ``entry_points.txt``."""
    entries, inside = [], False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            inside = line == f"[{ENTRY_POINT_GROUP}]"
            continue
        if inside and "=" in line:
            name, _, target = line.partition("=")
            entries.append((name.strip(), target.strip()))
    return entries


def _entry_point_candidates() -> list[_Candidate]:
    """Entry points of the ``soup`` group, found the way importlib.metadata finds them (``*.dist-info``
    folders on ``sys.path``, first one wins) but without importing it: its email-parsing machinery costs
    a tenth of ``soup --help``'s start-up budget."""
    seen: dict[str, _Candidate] = {}
    dists_seen: set[str] = set()
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for folder in names:
            if not folder.endswith((".dist-info", ".egg-info")):
                continue
            stem = folder.rsplit(".", 1)[0]
            dist, _, version = stem.partition("-")
            key = dist.lower().replace("-", "_").replace(".", "_")
            if key in dists_seen:
                continue
            dists_seen.add(key)
            path = os.path.join(entry or ".", folder, "entry_points.txt")
            try:
                with open(path, encoding="utf-8") as handle:
                    text = handle.read()
            except OSError:
                continue
            if f"[{ENTRY_POINT_GROUP}]" not in text:
                continue
            dist_name, core_range = _read_metadata(os.path.join(entry or ".", folder))
            for name, target in _soup_section(text):
                if name not in seen:
                    seen[name] = _Candidate(name, False, dist_name or dist, version or "?",
                                            lambda t=target: _load_target(t), core_range)
    return sorted(seen.values(), key=lambda c: c.name)


_CORE_REQUIREMENT = re.compile(
    r"^soup[-_.]core\s*(?:\[[^\]]*\])?\s*\(?\s*([<>=!~][^;()]*)?\)?\s*(;.*)?$", re.I
)


def _read_metadata(info_dir: str) -> tuple[str | None, str]:
    """The project name as written in METADATA (``soup-plugin-rewind``, not the folder's normalised form)
    and the soup-core range its ``Requires-Dist`` declares ("" when none, or only under an extra or a
    marker, which are not evaluated here)."""
    name, core_range = None, ""
    for meta in ("METADATA", "PKG-INFO"):
        try:
            with open(os.path.join(info_dir, meta), encoding="utf-8") as handle:
                for line in handle:
                    if line.startswith("Name:"):
                        name = line.split(":", 1)[1].strip()
                    elif line.startswith("Requires-Dist:"):
                        match = _CORE_REQUIREMENT.match(line.split(":", 1)[1].strip())
                        if match and match.group(1) and not match.group(2):
                            core_range = match.group(1).replace(" ", "")
                    elif not line.strip():
                        break  # the headers end; the long description follows
            return name, core_range
        except OSError:
            continue
    return None, ""


# ------------------------------------------------------------------------------- version ranges
# A small PEP 440 comparer for the operators that requirement ranges use (==, !=, <, <=, >, >=, ~=, ===,
# and the .* prefix forms), so that checking a plugin's soup-core range costs no import at start-up.

_VERSION = re.compile(
    r"^v?(?:(\d+)!)?(\d+(?:\.\d+)*)(?:[-_.]?(a|b|c|rc|alpha|beta|pre|preview)[-_.]?(\d*))?"
    r"(?:[-_.]?(?:post|rev|r)[-_.]?(\d*)|-(\d+))?(?:[-_.]?dev[-_.]?(\d*))?(?:\+([a-z0-9.]+))?$",
    re.I,
)
_PRE = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}
_INF = float("inf")


def version_key(version: str) -> tuple[Any, ...]:
    """A sort key for a PEP 440 version (local label ignored); raises ValueError when it is not one."""
    m = _VERSION.match(version.strip())
    if not m:
        raise ValueError(f"not a PEP 440 version: {version!r}")
    epoch, release, pre_l, pre_n, post_a, post_b, dev = m.groups()[:7]
    parts = [int(p) for p in release.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    post = post_a if post_a is not None else post_b
    if pre_l:
        pre: tuple[float, int] = (_PRE[pre_l.lower()], int(pre_n or 0))
    else:  # a bare dev release sorts before the release's pre-releases
        pre = (-_INF, 0) if dev is not None and post is None else (_INF, 0)
    return (int(epoch or 0), tuple(parts), pre, -_INF if post is None else int(post or 0),
            _INF if dev is None else int(dev or 0))


def _is_pre(key: tuple[Any, ...]) -> bool:
    return key[2][0] != _INF or key[4] != _INF


def _release(version: str) -> tuple[int, list[int]]:
    m = _VERSION.match(version.strip())
    if not m:
        raise ValueError(f"not a PEP 440 version: {version!r}")
    return int(m.group(1) or 0), [int(p) for p in m.group(2).split(".")]


def _prefix_match(version: str, prefix: str) -> bool:
    (epoch, have), (want_epoch, want) = _release(version), _release(prefix)
    have = have + [0] * len(want)
    return epoch == want_epoch and have[: len(want)] == want


def specifier_contains(specifier: str, version: str) -> bool:
    """Whether ``version`` satisfies every clause of ``specifier`` (``">=0.1,<0.2"``; "" accepts any).
    Pre-releases count (this asks about an installed version). Raises ValueError on what it cannot read."""
    key = version_key(version)
    public, _, local = version.strip().partition("+")
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        m = re.match(r"^(===|~=|==|!=|<=|>=|<|>)\s*(\S+)$", clause)
        if not m:
            raise ValueError(f"not a version clause: {clause!r}")
        op, target = m.groups()
        if op == "===":
            ok = version.strip().lower() == target.lower()
        elif target.endswith(".*"):
            if op not in ("==", "!="):
                raise ValueError(f"{op} takes no .* suffix: {clause!r}")
            if not re.match(r"^(\d+!)?\d+(\.\d+)*$", target[:-2]):
                raise ValueError(f".* follows release numbers only: {clause!r}")
            ok = _prefix_match(public, target[:-2]) == (op == "==")
        elif op == "~=":
            epoch, release = _release(target)
            if len(release) < 2:
                raise ValueError(f"~= needs two release numbers: {clause!r}")
            prefix = f"{epoch}!" + ".".join(map(str, release[:-1]))
            ok = key >= version_key(target) and _prefix_match(public, prefix)
        else:
            other = version_key(target)
            same_release = key[:2] == other[:2]
            if op in ("==", "!="):  # a local label counts only when the clause names one
                equal = key == other and ("+" not in target or local.lower() == target.split("+", 1)[1].lower())
                ok = equal == (op == "==")
            elif "+" in target:
                raise ValueError(f"{op} takes no local version label: {clause!r}")
            elif op in ("<=", ">="):
                ok = key <= other if op == "<=" else key >= other
            elif not same_release:
                ok = key < other if op == "<" else key > other
            elif op == "<":  # <V leaves out V's pre-releases (unless V is one), and a post V's dev releases
                if _is_pre(other):
                    ok = key < other
                else:
                    ok = other[3] != -_INF and key < other and not (key[:4] == other[:4] and key[4] != _INF)
            else:  # >V leaves out V's post-releases (unless V is a post or dev release)
                ok = key > other and (other[3] != -_INF or other[4] != _INF or key[2] != other[2])
        if not ok:
            return False
    return True


def _core_in_range(core_range: str) -> bool:
    from soup_core import __version__

    try:
        return specifier_contains(core_range, __version__)
    except ValueError:
        return True  # a range this comparer cannot read is left to pip (which checked it at install)


def _builtin_candidates() -> list[_Candidate]:
    from soup_core import __version__

    return [
        _Candidate(name, True, "soup-core", __version__, lambda m=module: importlib.import_module(m))
        for name, module in BUILTINS
    ]


def build_plugin_set(
    *,
    extra: Sequence[tuple[str, Any]] = (),
    entry_points: bool = True,
    builtins: bool = True,
    load_only: Iterable[str] | None = None,
    disabled: Iterable[str] = (),
    strict: bool = False,
) -> PluginSet:
    """Build a plugin set. ``extra`` are (name, plugin object) pairs registered after the entry points
    (used by :mod:`soup_core.testing`)."""
    plugins = PluginSet()
    candidates = _builtin_candidates() if builtins else []
    discovered = _entry_point_candidates() if entry_points else []
    extras = [_Candidate(n, False, "<test>", "0", lambda o=obj: o) for n, obj in extra]
    selectable = {c.name for c in discovered + extras}
    builtin_names = {name for name, _ in BUILTINS}
    load_only_list = list(load_only) if load_only is not None else None
    disabled_list = list(disabled)
    for name in (load_only_list or []) + disabled_list:
        if name in builtin_names:
            raise PluginSelectionError(f"{name!r} is a built-in part of soup-core and always loads")
        if name not in selectable:
            installed = ", ".join(sorted(selectable)) or "none"
            raise PluginSelectionError(f"no installed plugin is named {name!r} (installed plugins: {installed})")
    for candidate in candidates:
        plugins._register(candidate)
    for candidate in discovered + extras:
        skip = (load_only_list is not None and candidate.name not in load_only_list) or (
            candidate.name in disabled_list
        )
        if skip:
            plugins.plugins[candidate.name] = PluginInfo(
                candidate.name, False, candidate.distribution, candidate.version, status=DISABLED,
                reason="not in SOUP_LOAD_PLUGINS" if load_only_list is not None and candidate.name
                not in load_only_list else "disabled by SOUP_DISABLE_PLUGINS or -p no:NAME",
            )
            continue
        plugins._register(candidate)
    if strict and plugins.failures:
        raise PluginLoadError("; ".join(plugins.failures) + " (SOUP_STRICT_PLUGINS=1)")
    if os.environ.get("SOUP_TRACE_HOOKS") == "1":
        plugins.pm.trace.root.setwriter(lambda msg: print(msg, end="", file=sys.stderr))
        plugins.pm.enable_tracing()
    return plugins


#: names disabled on the command line (``soup -p no:NAME``); set by the CLI before plugins load
CLI_DISABLED: list[str] = []
_cache: dict[tuple[Any, ...], PluginSet] = {}


def load_plugins(env: Mapping[str, str] | None = None, *, refresh: bool = False) -> PluginSet:
    """The process's plugin set, selected by ``SOUP_LOAD_PLUGINS``, ``SOUP_DISABLE_PLUGINS``, ``-p no:NAME``
    and made strict by ``SOUP_STRICT_PLUGINS=1``. Cached per selection."""
    env = os.environ if env is None else env
    load_only = _split(env.get("SOUP_LOAD_PLUGINS"))
    disabled = (_split(env.get("SOUP_DISABLE_PLUGINS")) or []) + CLI_DISABLED
    strict = env.get("SOUP_STRICT_PLUGINS", "") not in ("", "0")
    key = (tuple(load_only) if load_only is not None else None, tuple(disabled), strict)
    if refresh or key not in _cache:
        _cache[key] = build_plugin_set(load_only=load_only, disabled=disabled, strict=strict)
    return _cache[key]


def reset_cache() -> None:
    _cache.clear()
