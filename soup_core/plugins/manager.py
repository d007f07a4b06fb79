"""Finds, selects, loads and registers plugins, on pluggy.

Every plugin, the built-in ``core.*`` parts included, goes through the same steps: its distribution's
soup-core range is checked (before importing it), it is imported, its ``SOUP_HOOK_API`` range checked,
registered with pluggy, checked for implementations that match no hookspec (``check_pending``), and its
registration hooks are called; what they return is committed to the registries only when all of it is
valid. A plugin that fails a step is unregistered and listed *failed*, with the reason and the fix; the
rest load. ``SOUP_STRICT_PLUGINS=1`` turns a failure into an error. Selection (``SOUP_LOAD_PLUGINS``,
``SOUP_DISABLE_PLUGINS``, ``soup -p no:NAME``) is pluggy's blocking: a blocked plugin is never imported.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import pluggy

from soup_core import distributions, hookspecs
from soup_core.capabilities import DISABLED, FAILED, Capabilities, PluginInfo
from soup_core.contracts import Command, ConfigField
from soup_core.hookspecs import HOOK_API_VERSION, PROJECT
from soup_core.plugins.registry import DuplicateNameError, Registry
from soup_core.probes import run_probe

#: Built-in parts: (plugin name, module). They always load and cannot be disabled.
BUILTINS: tuple[tuple[str, str], ...] = (
    ("core.cli", "soup_core.default_plugins.commands.plugin"),
    ("core.tracker", "soup_core.default_plugins.tracker"),
    ("core.formats", "soup_core.default_plugins.formats"),
    ("core.sft", "soup_core.default_plugins.sft"),
    ("core.transformers", "soup_core.default_plugins.transformers.plugin"),
)
#: registration hook -> (registry attribute, the attribute that names an item)
REGISTRATIONS: dict[str, tuple[str, str]] = {
    "soup_register_backends": ("backends", "name"), "soup_register_tasks": ("tasks", "name"),
    "soup_register_data_formats": ("data_formats", "name"), "soup_register_recorders": ("recorders", "name"),
    "soup_register_controllers": ("controllers", "name"), "soup_register_commands": ("commands", "name"),
    "soup_register_config_fields": ("config_fields", "path"),
    "soup_register_export_targets": ("export_targets", "name"),
}


class PluginLoadError(RuntimeError):
    """A plugin failed to load under ``SOUP_STRICT_PLUGINS=1``, or the selection names no plugin."""


class PluginSelectionError(PluginLoadError):
    """``SOUP_LOAD_PLUGINS`` / ``SOUP_DISABLE_PLUGINS`` / ``-p no:NAME`` names no installed plugin."""


class _Candidate(NamedTuple):
    info: PluginInfo
    load: Callable[[], Any]
    core_range: Callable[[], str] = lambda: ""


class PluginSet(Capabilities):
    """Everything the loaded plugins registered, and what happened to each plugin."""

    def __init__(self) -> None:
        super().__init__()
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        if os.environ.get("SOUP_TRACE_HOOKS") == "1":
            self.pm.add_hookcall_monitoring(lambda *_: None, _trace)
        self.plugins: dict[str, PluginInfo] = {}
        self.backends: Registry[type] = Registry("backend")
        self.tasks: Registry[type] = Registry("task")
        self.data_formats: Registry[Any] = Registry("data format")
        self.recorders: Registry[type] = Registry("recorder")
        self.controllers: Registry[type] = Registry("controller")
        self.commands: Registry[Command] = Registry("command")
        self.config_fields: Registry[ConfigField] = Registry("config field")
        self.export_targets: Registry[Any] = Registry("export target")
        self.failures: list[str] = []

    def not_loaded(self) -> list[PluginInfo]:
        """Installed plugins whose hooks are not registered (disabled or failed), for messages that must
        say why a name is missing. Found from metadata: a disabled plugin is never imported for this."""
        return [p for p in self.plugins.values() if p.status in (DISABLED, FAILED)]

    def call_one(self, hook: str, plugin: str, **kwargs: Any) -> Any:
        """Call one plugin's implementation of ``hook`` through pluggy (argument matching, tracing), so
        that what it returns or raises is pinned on that plugin."""
        others = [p for name, p in self.pm.list_name_plugin() if name != plugin and p is not None]
        return self.pm.subset_hook_caller(hook, others)(**kwargs)

    def _implementers(self, hook: str) -> list[str]:
        # pluggy calls the last registered first: the built-ins answer last
        return [impl.plugin_name for impl in reversed(getattr(self.pm.hook, hook).get_hookimpls())]

    def call_load_model(self, **kwargs: Any) -> tuple[Any, str]:
        """``soup_load_model`` as a firstresult hook: (the first non-None answer, the plugin that gave it).
        A raising implementation stops the run with the plugin named."""
        for plugin in self._implementers("soup_load_model"):
            result = self._pinned(plugin, "failed while loading the model", "soup_load_model", **kwargs)
            if result is not None:
                return result, plugin
        raise RuntimeError(f"no plugin could load a model for backend {kwargs.get('backend')!r}")

    def call_preflight(self, config: Any) -> list[tuple[str, Any]]:
        """Every ``soup_preflight``: (plugin, report) for each report that is not None."""
        reports = [(p, self._pinned(p, "failed in its pre-flight check", "soup_preflight", config=config))
                   for p in self._implementers("soup_preflight")]
        return [(plugin, report[0]) for plugin, report in reports if report]

    def _pinned(self, plugin: str, doing: str, hook: str, **kwargs: Any) -> Any:
        try:
            return self.call_one(hook, plugin, **kwargs)
        except Exception as exc:
            raise RuntimeError(f"plugin {plugin!r} {doing}: {type(exc).__name__}: {exc}") from exc

    def _register(self, candidate: _Candidate, *, check_range: bool) -> None:
        info = candidate.info
        self.plugins[info.name] = info
        from soup_core import __version__

        core_range = candidate.core_range() if check_range else ""
        if core_range and not distributions.in_range(core_range, __version__):
            # checked before importing: a plugin built for another core may not even import
            return self._fail(info, f"its distribution requires soup-core{core_range}; this is soup-core "
                                    f"{__version__}", f"pip install --upgrade {info.distribution} (or pip install "
                                                      f"\"soup-core{core_range}\")")
        try:
            module = _hashable(candidate.load(), info.name)
        except Exception as exc:  # noqa: BLE001 - any import failure is the plugin's, not ours
            return self._fail(info, f"import failed: {type(exc).__name__}: {exc}",
                              f"pip install --force-reinstall {info.distribution}")
        api = getattr(module, "SOUP_HOOK_API", None)
        if not (isinstance(api, tuple) and len(api) == 2 and all(isinstance(v, int) for v in api)):
            return self._fail(info, "declares no SOUP_HOOK_API = (min, max) hook-API range",
                              "the plugin's author must declare the hook-API versions it supports")
        info.hook_api = api
        if not api[0] <= HOOK_API_VERSION <= api[1]:
            return self._fail(info, f"supports hook API {api[0]}..{api[1]}; this soup-core implements "
                                    f"{HOOK_API_VERSION}", f"pip install --upgrade {info.distribution} soup-core")
        try:
            self.pm.register(module, name=info.name)
        except Exception as exc:  # pluggy.PluginValidationError, or the object is registered already
            return self._fail(info, f"invalid hook implementation: {exc}", "report this to the plugin's author")
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError:
            unknown = [name for name, caller in vars(self.pm.hook).items() if not name.startswith("_")
                       and not caller.has_spec() and any(i.plugin_name == info.name and not i.optionalhook
                                                         for i in caller.get_hookimpls())]
            self.pm.unregister(name=info.name)
            return self._fail(info, "; ".join(map(_no_such_hook, unknown)), "rename the hook (docs/plugins.md "
                              "lists every hook), or mark it @hookimpl(optionalhook=True) if a later core has it")
        try:
            staged = {hook: [item for items in self.call_one(hook, info.name) for item in items or ()]
                      for hook in [*REGISTRATIONS, "soup_register_support", "soup_register_probes"]}
            self._commit(info, staged)
        except DuplicateNameError as exc:
            self.pm.unregister(name=info.name)
            return self._fail(info, str(exc), f"pip uninstall {info.distribution}, or soup -p no:{info.name}")
        except Exception as exc:  # noqa: BLE001 - a registration hook that raises fails its plugin only
            self.pm.unregister(name=info.name)
            return self._fail(info, f"raised while registering: {type(exc).__name__}: {exc}",
                              "report this to the plugin's author")
        self.record_probes(info, [(p, run_probe(p.check)) for p in info.probes if not p.deep])

    def _commit(self, info: PluginInfo, staged: dict[str, list[Any]]) -> None:
        self.check_support(staged["soup_register_support"])
        # validate everything first so a refused plugin leaves no trace in the registries
        for hook, (attr, key) in REGISTRATIONS.items():
            registry: Registry[Any] = getattr(self, attr)
            names = [getattr(item, key) for item in staged[hook]]
            for i, name in enumerate(names):
                if not name or name in registry or name in names[:i]:
                    owner = registry.owner(name) if name in registry else info.name
                    raise DuplicateNameError(registry.kind, name or "<empty name>", owner, info.name)
        for hook, (attr, key) in REGISTRATIONS.items():
            for item in staged[hook]:
                getattr(self, attr).add(getattr(item, key), item, info.name)
                info.provides.setdefault(attr.replace("_", " "), []).append(getattr(item, key))
        self.add_support(staged["soup_register_support"])
        info.probes = list(staged["soup_register_probes"])

    def _fail(self, info: PluginInfo, reason: str, fix: str) -> None:
        info.status, info.reason, info.fix = FAILED, reason, fix
        self.failures.append(f"plugin {info.name!r} ({info.distribution}): {reason}")


def _hashable(plugin: Any, name: str) -> Any:
    # pluggy keeps plugins in sets (subset_hook_caller): an unhashable object (a SimpleNamespace) gets a
    # module with the same attributes, and the same hook functions
    if getattr(type(plugin), "__hash__", None) is not None:
        return plugin
    proxy = types.ModuleType(name)
    proxy.__dict__.update({k: getattr(plugin, k) for k in dir(plugin) if not k.startswith("__")})
    return proxy


def _no_such_hook(name: str) -> str:
    close = difflib.get_close_matches(name, [n for n in dir(hookspecs) if n.startswith("soup_")], n=1, cutoff=0.6)
    return f"hook {name!r} matches no hookspec" + (f" — did you mean {close[0]!r}?" if close else "")


def _trace(outcome: Any, hook: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    plugins = ", ".join(impl.plugin_name for impl in impls)
    if outcome.exception is not None:
        verdict = f"raised {type(outcome.exception).__name__}"
    else:
        result = outcome.get_result()
        verdict = f"registered {sum(len(r or ()) for r in result)}" if hook in REGISTRATIONS else \
            "passed" if result in (None, []) else "answered"
    print(f"[hook] {hook}: {plugins} {verdict}", file=sys.stderr)


def build_plugin_set(
    *,
    extra: Sequence[tuple[str, Any]] = (),
    entry_points: bool = True,
    builtins: bool = True,
    load_only: Iterable[str] | None = None,
    disabled: Iterable[str] = (),
    cli_disabled: Iterable[str] = (),
    strict: bool = False,
    check_ranges: bool = True,
) -> PluginSet:
    """Build a plugin set: the built-ins, the ``soup`` entry points, then ``extra`` (name, plugin object)
    pairs (used by :mod:`soup_core.testing`; one named like an installed plugin takes its place, and that
    plugin is not imported). ``check_ranges=False`` skips reading each distribution's
    soup-core range (``soup --help`` does, so it never imports ``packaging``)."""
    from soup_core import __version__

    plugins = PluginSet()
    candidates = [_Candidate(PluginInfo(n, True, "soup-core", __version__), lambda m=m: importlib.import_module(m))
                  for n, m in BUILTINS] if builtins else []
    for ep in distributions.soup_entry_points() if entry_points else ():
        # two distributions claim one name: the first wins; an extra of that name replaces both
        if all(ep.name != c.info.name for c in candidates) and ep.name not in dict(extra):
            candidates.append(_Candidate(PluginInfo(ep.name, False, ep.dist.name, ep.dist.version), ep.load,
                                         lambda d=ep.dist: distributions.declared_range(d, "soup-core")))
    candidates += [_Candidate(PluginInfo(n, False, "<test>", "0"), lambda o=obj: o) for n, obj in extra]
    selectable = {c.info.name for c in candidates if not c.info.builtin}
    load_only = list(load_only) if load_only is not None else None
    why = {n: "disabled by SOUP_DISABLE_PLUGINS" for n in disabled} | {n: f"disabled by -p no:{n}"
                                                                        for n in cli_disabled}
    for name in [*(load_only or []), *why]:
        if name in dict(BUILTINS):
            raise PluginSelectionError(f"{name!r} is a built-in part of soup-core and always loads")
        if name not in selectable:
            installed = ", ".join(sorted(selectable)) or "none"
            raise PluginSelectionError(f"no installed plugin is named {name!r} (installed plugins: {installed})")
    if load_only is not None:
        why.update({n: "not in SOUP_LOAD_PLUGINS" for n in selectable - set(load_only)})
    for name in why:
        plugins.pm.set_blocked(name)
    for candidate in candidates:
        if plugins.pm.is_blocked(candidate.info.name):
            candidate.info.status, candidate.info.reason = DISABLED, why[candidate.info.name]
            plugins.plugins[candidate.info.name] = candidate.info
        else:
            plugins._register(candidate, check_range=check_ranges)
    if strict and plugins.failures:
        raise PluginLoadError("; ".join(plugins.failures) + " (SOUP_STRICT_PLUGINS=1)")
    return plugins


#: names disabled on the command line (``soup -p no:NAME``); set by the CLI before plugins load
CLI_DISABLED: list[str] = []
_cache: dict[tuple[Any, ...], PluginSet] = {}


def load_plugins(env: Mapping[str, str] | None = None, *, refresh: bool = False,
                 check_ranges: bool = True) -> PluginSet:
    """The process's plugin set, selected by ``SOUP_LOAD_PLUGINS``, ``SOUP_DISABLE_PLUGINS``, ``-p no:NAME``
    and made strict by ``SOUP_STRICT_PLUGINS=1``. Cached per selection."""
    env = os.environ if env is None else env
    load_only = _split(env.get("SOUP_LOAD_PLUGINS"))
    disabled = _split(env.get("SOUP_DISABLE_PLUGINS")) or []
    strict = env.get("SOUP_STRICT_PLUGINS", "") not in ("", "0")
    key = (tuple(load_only) if load_only is not None else None, tuple(disabled), tuple(CLI_DISABLED), strict,
           check_ranges)
    if refresh or key not in _cache:
        _cache[key] = build_plugin_set(load_only=load_only, disabled=disabled, cli_disabled=CLI_DISABLED,
                                       strict=strict, check_ranges=check_ranges)
    return _cache[key]


def _split(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def reset_cache() -> None:
    _cache.clear()
