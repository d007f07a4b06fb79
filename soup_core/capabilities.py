"""What each plugin and each (backend, task) pair can do: a plugin's status, the support table and the
capability probes' verdicts. The plugin manager fills them as plugins register (``PluginSet`` is one)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from soup_core.contracts import Probe, ProbeResult, Support
from soup_core.probes import run_deep_probe, run_probe

#: a plugin's status, as ``soup plugins list`` shows it
OK, UNAVAILABLE, FAILED, DISABLED = "ok", "unavailable", "failed", "disabled"


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
        keys = ("name", "builtin", "distribution", "version", "status", "provides", "details")
        return {**{k: getattr(self, k) for k in keys}, "reason": self.reason or None, "fix": self.fix or None,
                "hook_api": list(self.hook_api) if self.hook_api else None}


class Capabilities:
    """The support table and the probe verdicts. Needs ``plugins`` (name -> info with ``status``,
    ``probes``, ``details``), ``backends`` and ``tasks`` registries from the class it is mixed into."""

    plugins: dict[str, PluginInfo]
    backends: Any
    tasks: Any

    def __init__(self) -> None:
        self._pair_support: dict[tuple[str, str], frozenset[str]] = {}
        self._capability_support: list[Support] = []
        self._pair_reasons: dict[tuple[str, str], dict[str, str]] = {}
        #: probes that failed for one scope ("task:ppo", "backend:mlx") -> (plugin, result)
        self.unavailable_scopes: dict[str, tuple[str, ProbeResult]] = {}

    @property
    def support(self) -> dict[tuple[str, str], frozenset[str]]:
        """(backend, task) -> the fields that pair honours: each pair's own rows, plus the capability
        rows (``task="*"``) whose capability the task declares."""
        table = dict(self._pair_support)
        for row in self._capability_support:
            for backend, task in table:
                if backend == row.backend and row.capability in (getattr(self.tasks.get(task), "capabilities", ())
                                                                 or ()):
                    table[(backend, task)] |= frozenset(row.fields)
        return table

    @property
    def support_reasons(self) -> dict[tuple[str, str], dict[str, str]]:
        """(backend, task) -> field path -> why that pair leaves the field out: each pair's own reasons, and a
        capability row's for the tasks of its backend that do not declare the capability."""
        reasons = {pair: dict(why) for pair, why in self._pair_reasons.items()}
        for row in self._capability_support:
            for backend, task in self._pair_support:
                lacks = row.capability not in (getattr(self.tasks.get(task), "capabilities", ()) or ())
                if backend == row.backend and lacks and row.reasons:
                    reasons.setdefault((backend, task), {}).update(
                        {k: v for k, v in row.reasons.items() if k not in reasons.get((backend, task), {})})
        return reasons

    @staticmethod
    def check_support(rows: Sequence[Support]) -> None:
        for row in rows:
            if (row.task == "*") != bool(row.capability):
                raise ValueError(f"support row ({row.backend}, {row.task}): a row for every task (task='*') "
                                 "needs a capability, and only such a row may name one")

    def add_support(self, rows: Sequence[Support]) -> None:
        """Merge rows: those for one pair from several plugins add up."""
        for row in rows:
            if row.task == "*":
                self._capability_support.append(row)
                continue
            key = (row.backend, row.task)
            self._pair_support[key] = self._pair_support.get(key, frozenset()) | frozenset(row.fields)
            if row.reasons:
                self._pair_reasons.setdefault(key, {}).update(row.reasons)

    def requirements_for(self, *, backend: str, task: str, deep: bool = True) -> list[str]:
        """Reasons a run on (backend, task) cannot start: unavailable plugins or scopes, failed deep
        probes. Empty when the run may go ahead."""
        problems: list[str] = []
        for kind, name in (("backend", backend), ("task", task)):
            registry = getattr(self, kind + "s")
            if name not in registry:
                continue
            plugin, scope = self.plugins[registry.owner(name)], f"{kind}:{name}"
            failed = [(None, ProbeResult(False, plugin.reason, plugin.fix))] if plugin.status == UNAVAILABLE else []
            if not failed and scope in self.unavailable_scopes:
                failed = [(None, self.unavailable_scopes[scope][1])]
            if not failed and deep:
                failed = [(p, r) for p in plugin.probes if p.deep and p.scope in (None, scope)
                          for r in [run_deep_probe(plugin.name, p)] if not r.ok]
            for probe, result in failed:
                what = f"failed probe {probe.name!r}" if probe else "is unavailable"
                problems.append(f"{kind} {name!r} (plugin {plugin.name!r}) {what}: {result.reason}"
                                + (f" — fix: {result.fix}" if result.fix else ""))
        return problems

    def deep_check(self) -> dict[str, list[tuple[Probe, ProbeResult]]]:
        """Run every deep probe of every loaded plugin (``soup plugins list --check``)."""
        out: dict[str, list[tuple[Probe, ProbeResult]]] = {}
        for info in (p for p in self.plugins.values() if p.status in (OK, UNAVAILABLE)):
            # a deep probe whose scope already failed its cheap probe would only repeat the failure, less clearly
            probes = [p for p in info.probes if p.deep and info.status == OK and p.scope not in self.unavailable_scopes]
            out[info.name] = [(p, run_probe(p.check)) for p in probes]
            self.record_probes(info, out[info.name])
        return out

    def record_probes(self, info: PluginInfo, results: Iterable[tuple[Probe, ProbeResult]]) -> None:
        """A failed probe makes its scope unavailable, or, unscoped, the whole plugin."""
        for probe, result in results:
            if result.ok:
                info.details += [result.detail] if result.detail else []
            elif probe.scope is not None:
                self.unavailable_scopes[probe.scope] = (info.name, result)
            elif info.status == OK:
                info.status, info.reason, info.fix = UNAVAILABLE, result.reason, result.fix
