"""``soup doctor``: this machine, this installation, and the one ``pip install`` line that fixes it.

It reports the Python and the platform; the devices (CUDA with bf16 asked without emulation, MPS, MLX,
CPU); every installed soup distribution and plugin with its probe results; and every dependency that
soup-core and the plugins declare, read from their *installed* metadata (``importlib.metadata``), never
from a second, hand-kept copy, checked against the installed version. It exits 1 when a required
dependency is missing or out of range, and prints the ``pip install`` line that fixes all of them. Unless
``--quick``, it also lists the third-party warnings Soup hides that this installation gives, and what each means
(:func:`soup_core.default_plugins.transformers.noise.hidden_warnings`).

Which dependencies are required: a distribution's plain ``Requires-Dist``; those of an extra that another
installed soup distribution asks for (``soup-plugin-streaming`` requires ``soup-core[train]``, so torch is
required); and those of an extra a soup distribution asks of a third-party package (``mlx[cpu]``). The
other extras are optional: shown, checked when installed, never failing the run. A requirement whose
marker excludes this platform (``sys_platform == 'darwin'`` on Linux) is shown as not applicable.

Requirement lines, specifiers and markers are read by ``packaging`` (a dependency of soup-core), through
:mod:`soup_core.distributions`. Import-light at module level: torch is imported when the devices are asked about.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from soup_core import distributions
from soup_core.probes import module_findable

OK, MISSING, OUT_OF_RANGE, OPTIONAL, NOT_APPLICABLE = "ok", "missing", "out of range", "optional", "not applicable"


# ------------------------------------------------------------------------------------ requirements


@dataclass(frozen=True)
class Requirement:
    """One ``Requires-Dist`` line: ``name[extras] specifier ; marker``, as ``packaging`` reads it."""

    name: str
    extras: tuple[str, ...] = ()
    specifier: str = ""
    marker: str = ""


normalise = distributions.canonical


def parse_requirement(text: str) -> Requirement:
    """Parse a requirement line (``packaging`` reads it; raises ``packaging``'s InvalidRequirement)."""
    req = distributions.requirement(text)
    specs = ",".join(sorted(str(s) for s in req.specifier))
    return Requirement(req.name, tuple(sorted(req.extras)), specs, str(req.marker or ""))


def soup_distributions(path: Sequence[str] | None = None) -> list[Any]:
    """Installed soup distributions (soup-core, ``soup-plugin-*``, and any with a ``soup`` entry point),
    the first of each name on the path, soup-core first."""
    found: dict[str, Any] = {}
    for dist in distributions.distributions(path):
        name = normalise(dist.metadata["Name"] or "")
        soup = name == "soup-core" or name.startswith("soup-plugin-") or any(
            ep.group == distributions.ENTRY_POINT_GROUP for ep in dist.entry_points)
        if soup and name not in found:
            found[name] = dist
    return [found[n] for n in sorted(found, key=lambda n: (n != "soup-core", n))]


installed_version = distributions.version_of


def _editable(dist: Any) -> bool:
    import json

    try:
        info = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return False
    return bool(info.get("dir_info", {}).get("editable"))


@dataclass
class DependencyCheck:
    """One declared dependency of one distribution, against what is installed."""

    dependent: str  # who declares it: "soup-plugin-rewind", "soup-core[train]", "mlx[cpu]"
    name: str
    specifier: str
    extras: tuple[str, ...]
    required: bool
    installed: str | None
    status: str  # ok / missing / out of range / optional / not applicable
    requirement: str  # the line as declared

    @property
    def failed(self) -> bool:
        return self.required and self.status in (MISSING, OUT_OF_RANGE)


def _check(dependent: str, line: str, req: Requirement, required: bool, path: Sequence[str] | None
           ) -> DependencyCheck:
    version = installed_version(req.name, path)
    if version is None:
        status = MISSING if required else OPTIONAL
    elif req.specifier and not distributions.in_range(req.specifier, version):
        status = OUT_OF_RANGE
    else:
        status = OK
    return DependencyCheck(dependent, req.name, req.specifier, req.extras, required, version, status, line)


def check_dependencies(path: Sequence[str] | None = None) -> list[DependencyCheck]:
    """Every dependency the installed soup distributions declare, checked (see the module docstring for
    which ones are required)."""
    dists = soup_distributions(path)
    soup_names = {normalise(d.metadata["Name"]) for d in dists}
    declared: list[tuple[str, str, Requirement]] = []  # (dependent dist, line, requirement)
    offered: dict[str, list[str]] = {}  # dependent dist -> the extras it declares
    for dist in dists:
        offered[str(dist.metadata["Name"])] = list(dist.metadata.get_all("Provides-Extra") or ())
        for line in dist.requires or []:
            declared.append((str(dist.metadata["Name"]), line, parse_requirement(line)))
    # extras that installed soup distributions ask of each other (soup-core[train]) or of others (mlx[cpu])
    wanted: dict[str, set[str]] = {}
    for _, _, req in declared:
        if req.extras and distributions.marker_holds(req.marker):
            wanted.setdefault(normalise(req.name), set()).update(req.extras)
    checks: list[DependencyCheck] = []
    for dependent, line, req in declared:
        active = sorted(wanted.get(normalise(dependent), ()))
        if distributions.marker_holds(req.marker):
            checks.append(_check(dependent, line, req, True, path))
            continue
        extras = [e for e in active if distributions.marker_holds(req.marker, e)]
        if extras:
            checks.append(_check(f"{dependent}[{','.join(extras)}]", line, req, True, path))
            continue
        optional = [e for e in offered[dependent] if distributions.marker_holds(req.marker, e)]
        if optional:
            checks.append(_check(f"{dependent}[{','.join(optional)}]", line, req, False, path))
        else:
            checks.append(DependencyCheck(dependent, req.name, req.specifier, req.extras, False,
                                          installed_version(req.name, path), NOT_APPLICABLE, line))
    # one level into third-party extras a soup distribution asks for: mlx[cpu] must bring mlx-cpu
    for project, extras in sorted(wanted.items()):
        if project in soup_names:
            continue
        found = list(distributions.distributions(path, project))
        if not found:
            continue
        for line in found[0].requires or []:
            req = parse_requirement(line)
            if distributions.marker_holds(req.marker):
                continue  # its plain dependencies are pip's business, not soup's
            hits = [e for e in sorted(extras) if distributions.marker_holds(req.marker, e)]
            if hits:
                dependent = f"{found[0].metadata['Name']}[{','.join(hits)}]"
                checks.append(_check(dependent, line, req, True, path))
    return checks


def fix_command(checks: Sequence[DependencyCheck]) -> str | None:
    """The one ``pip install`` line that installs every failed requirement (ranges merged per name)."""
    merged: dict[str, tuple[str, set[str], list[str]]] = {}
    for check in checks:
        if not check.failed:
            continue
        key = normalise(check.name)
        name, extras, specs = merged.setdefault(key, (check.name, set(), []))
        extras.update(check.extras)
        for clause in filter(None, check.specifier.split(",")):
            if clause not in specs:
                specs.append(clause)
    if not merged:
        return None
    parts = []
    for name, extras, specs in merged.values():
        extra = f"[{','.join(sorted(extras))}]" if extras else ""
        parts.append(f'"{name}{extra}{",".join(specs)}"')
    return "pip install " + " ".join(parts)


# ------------------------------------------------------------------------------------------- devices


def device_report() -> dict[str, Any]:
    """CPU, CUDA (each device: name, capability, memory, bf16 without emulation), MPS and MLX."""
    import platform
    out: dict[str, Any] = {"cpu": {"cores": os.cpu_count(), "machine": platform.machine()}}
    if not module_findable("torch").ok:
        reason = 'torch is not installed (pip install "soup-core[train]")'
        out.update(torch=None, cuda={"available": False, "reason": reason}, mps={"available": False, "reason": reason})
    else:
        found = _torch_devices()
        out["cpu"].update(found.pop("cpu", {}))
        out.update(found)
    out["mlx"] = _mlx_device()
    return out


def _torch_devices() -> dict[str, Any]:
    import inspect

    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken torch is a finding, not a crash
        reason = f"import torch failed: {type(exc).__name__}: {exc}"
        return {"torch": None, "cuda": {"available": False, "reason": reason},
                "mps": {"available": False, "reason": reason}}
    out: dict[str, Any] = {"torch": torch.__version__}
    out["cpu"] = {"threads": torch.get_num_threads()}
    cuda: dict[str, Any] = {"available": bool(torch.cuda.is_available()), "version": torch.version.cuda}
    if cuda["available"]:
        asks_emulation = "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters
        devices = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            with torch.cuda.device(index):
                if asks_emulation:  # emulated bf16 runs, slowly: only native support counts
                    bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))
                else:
                    bf16 = props.major >= 8
            devices.append({"index": index, "name": props.name, "capability": f"{props.major}.{props.minor}",
                            "memory_gib": round(props.total_memory / 2**30, 1), "bf16": bf16})
        cuda["devices"] = devices
    else:
        cuda["reason"] = ("this torch is a CPU-only build" if torch.version.cuda is None
                          else "no CUDA device is visible")
    out["cuda"] = cuda
    mps = getattr(torch.backends, "mps", None)
    out["mps"] = {"available": bool(mps and mps.is_available()), "built": bool(mps and mps.is_built())}
    return out


def _mlx_device() -> dict[str, Any]:
    if not module_findable("mlx").ok:
        return {"available": False, "reason": "mlx is not installed"}
    try:
        import mlx.core as mx
    except Exception as exc:  # noqa: BLE001 - e.g. libmlx.so missing: plain `mlx` on Linux
        fix = ' (on Linux: pip install "mlx[cpu]")' if sys.platform.startswith("linux") else ""
        return {"available": False, "reason": f"import mlx.core failed: {type(exc).__name__}: {exc}{fix}"}
    metal = getattr(mx, "metal", None)
    try:
        on_metal = bool(metal and metal.is_available())
    except Exception:  # noqa: BLE001 - asking must not break the report
        on_metal = False
    return {"available": True, "version": getattr(mx, "__version__", "?"),
            "default_device": str(mx.default_device()), "metal": on_metal}


# -------------------------------------------------------------------------------------------- report


@dataclass
class DoctorReport:
    python: dict[str, Any]
    platform: dict[str, Any]
    devices: dict[str, Any]
    distributions: list[dict[str, Any]]
    plugins: list[dict[str, Any]]
    unavailable: dict[str, Any]
    dependencies: list[DependencyCheck] = field(default_factory=list)
    #: third-party warnings Soup hides that this installation gives (None: not checked, --quick)
    hidden_warnings: list[dict[str, str]] | None = None

    @property
    def failed(self) -> list[DependencyCheck]:
        return [c for c in self.dependencies if c.failed]

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": not self.failed,
            "python": self.python,
            "platform": self.platform,
            "devices": self.devices,
            "distributions": self.distributions,
            "plugins": self.plugins,
            "unavailable": self.unavailable,
            "dependencies": [{**asdict(c), "extras": list(c.extras)} for c in self.dependencies],
            "fix": fix_command(self.dependencies),
            "hidden_warnings": self.hidden_warnings,
        }


def build_report(*, deep: bool = True, devices: bool = True) -> DoctorReport:
    """Everything ``soup doctor`` shows."""
    import platform

    from soup_core.plugins import load_plugins

    dists = [
        {"name": d.metadata["Name"], "version": str(d.version), "editable": _editable(d),
         "location": str(getattr(d, "_path", "") or "")}
        for d in soup_distributions()
    ]
    plugins = load_plugins()
    hidden = None
    if deep:
        plugins.deep_check()
        from soup_core.default_plugins.transformers.noise import hidden_warnings

        hidden = hidden_warnings()
    return DoctorReport(
        python={"version": platform.python_version(), "implementation": platform.python_implementation(),
                "executable": sys.executable},
        platform={"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
                  "sys_platform": sys.platform, "description": platform.platform()},
        devices=device_report() if devices else {},
        distributions=dists,
        plugins=[info.to_json() for info in plugins.plugins.values()],
        unavailable={scope: {"plugin": plugin, "reason": result.reason, "fix": result.fix or None}
                     for scope, (plugin, result) in plugins.unavailable_scopes.items()},
        dependencies=check_dependencies(),
        hidden_warnings=hidden,
    )


def _device_lines(devices: dict[str, Any]) -> list[str]:
    cpu = devices.get("cpu", {})
    threads = f", torch uses {cpu['threads']} threads" if "threads" in cpu else ""
    lines = [f"CPU   {cpu.get('cores')} cores ({cpu.get('machine')}){threads}"]
    cuda = devices.get("cuda", {})
    if cuda.get("available"):
        for d in cuda.get("devices", []):
            bf16 = "bf16: yes" if d["bf16"] else "bf16: no (not without emulation)"
            lines.append(f"CUDA  {d['index']}: {d['name']}, capability {d['capability']}, "
                         f"{d['memory_gib']} GiB, {bf16} (CUDA {cuda.get('version')})")
    else:
        lines.append(f"CUDA  not available: {cuda.get('reason', '?')}")
    mps = devices.get("mps", {})
    lines.append("MPS   available" if mps.get("available") else
                 f"MPS   not available{': ' + mps['reason'] if mps.get('reason') else ''}")
    mlx = devices.get("mlx", {})
    if mlx.get("available"):
        metal = ", Metal" if mlx.get("metal") else ""
        lines.append(f"MLX   {mlx.get('version')}, default device {mlx.get('default_device')}{metal}")
    else:
        lines.append(f"MLX   not available: {mlx.get('reason', '?')}")
    return lines


def print_report(report: DoctorReport) -> None:
    """The human-readable report (plain lines: never cut by a narrow terminal)."""
    from rich.markup import escape

    from soup_core.ui import console

    def say(text: str, style: str = "") -> None:
        console.print(f"[{style}]{escape(text)}[/]" if style else escape(text))

    py, plat = report.python, report.platform
    say("soup doctor", "bold")
    say(f"Python    {py['version']} ({py['implementation']}) {py['executable']}")
    say(f"Platform  {plat['description']} ({plat['sys_platform']}, {plat['machine']})")
    if report.devices:
        say("\nDevices", "bold")
        for line in _device_lines(report.devices):
            say("  " + line)
    say("\nSoup distributions", "bold")
    for d in report.distributions:
        say(f"  {d['name']} {d['version']}" + (" (editable)" if d["editable"] else ""))
    say("\nPlugins", "bold")
    styles = {"ok": "green", "unavailable": "yellow", "failed": "red", "disabled": "dim"}
    for p in report.plugins:
        line = f"  {p['name']:<18} {p['status']:<11} {p['distribution']} {p['version']}"
        if p["details"]:
            line += " — " + "; ".join(p["details"])
        say(line, styles.get(p["status"], ""))
        if p["reason"]:
            say(f"      {p['reason']}" + (f" — fix: {p['fix']}" if p["fix"] else ""))
    for scope, info in report.unavailable.items():
        say(f"  {scope} (plugin {info['plugin']}) unavailable: {info['reason']}"
            + (f" — fix: {info['fix']}" if info["fix"] else ""), "yellow")
    say("\nDependencies (declared in the installed metadata)", "bold")
    groups: dict[str, list[DependencyCheck]] = {}
    for check in report.dependencies:
        groups.setdefault(check.dependent, []).append(check)
    for dependent, checks in groups.items():
        say(f"  {dependent}")
        for c in checks:
            _say_check(say, c)
    if report.hidden_warnings:
        say("\nWarnings Soup hides, and what they mean here", "bold")
        for w in report.hidden_warnings:
            say(f"  {w['source']}: {w['hidden']}", "yellow")
            say(f"      {w['matters']}")
    failed = report.failed
    if not failed:
        say("\nEvery required dependency is installed and in range"
            + (f"; {len(report.hidden_warnings)} hidden warning(s) above." if report.hidden_warnings else "."),
            "green")
        return
    say(f"\n{len(failed)} required dependenc{'y is' if len(failed) == 1 else 'ies are'} missing or out of range:",
        "bold red")
    for c in failed:
        say(f"  {c.name} {c.specifier} (required by {c.dependent}): "
            + ("not installed" if c.installed is None else f"{c.installed} is installed"))
    say(f"Fix: {fix_command(failed)}", "bold")


_SHOWN = {OK: "ok", MISSING: "MISSING", OUT_OF_RANGE: "OUT OF RANGE", OPTIONAL: "optional, not installed",
          NOT_APPLICABLE: "not for this platform"}


def _say_check(say: Any, c: DependencyCheck) -> None:
    status = _SHOWN[c.status] if c.required or c.status != OK else "ok (optional)"
    if c.status == OUT_OF_RANGE and not c.required:
        status = "out of range (optional)"
    style = "red" if c.failed else ("yellow" if c.status == OUT_OF_RANGE else "")
    have = c.installed or "not installed"
    say(f"    {c.name:<22} {have:<16} wants {c.specifier or 'any':<18} {status}", style)
