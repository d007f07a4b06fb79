"""``soup doctor``: requirements read from installed metadata, markers and extras, the one fix line, devices.

The real-venv cases (exit 0 in a complete venv, exit 1 with a dependency removed, its fix line run, and the
installed metadata checked against the pyproject files) are in test_clean_install.py; here the same logic
runs on distributions laid out in a temp folder, as pip would lay them out.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import types
from pathlib import Path

import pytest

from soup_core.default_plugins.commands import doctor as doctor_cmd
from soup_core.default_plugins.commands.doctor import (
    MISSING,
    NOT_APPLICABLE,
    OK,
    OPTIONAL,
    OUT_OF_RANGE,
    check_dependencies,
    fix_command,
    parse_requirement,
)
from soup_core.testing import make_distribution, run_soup

ROOT = Path(__file__).resolve().parents[1]

def test_requirements_are_read_from_the_installed_metadata_by_packaging() -> None:
    import importlib.metadata

    lines = importlib.metadata.requires("soup-core")
    assert lines  # the installed metadata is what is read
    parsed = [parse_requirement(line) for line in lines]
    assert any(r.name == "pydantic" and r.specifier == "<3,>=2.7" for r in parsed)
    assert any(r.name == "torch" and r.marker == 'extra == "train"' for r in parsed)


def test_control_a_line_that_is_not_a_requirement_is_refused() -> None:
    from packaging.requirements import InvalidRequirement

    with pytest.raises(InvalidRequirement):
        parse_requirement("soup-core >=>= 1")


FAKE_PLUGIN = "SOUP_HOOK_API = (1, 1)\n"


def fake_site(site: Path, *, broken: bool) -> Path:
    """A soup plugin distribution and a third-party package with a ``cpu`` extra, as pip lays them out."""
    missing = "definitely-not-installed-dep>=1" if broken else "pluggy>=1.0"
    too_old = "pluggy<1" if broken else "pluggy<99"
    make_distribution(site, "soup-plugin-fake", entry_points={"fake": "soup_fake_plugin"},
                      modules={"soup_fake_plugin.py": FAKE_PLUGIN},
                      requires=["soup-core>=0.1,<0.2", missing, too_old,
                                "nothere>=1; sys_platform == 'no-such-os'", "plotlib-nope>=3; extra == 'plot'",
                                "fakehelper[cpu]>=1"], extras=["plot"])
    make_distribution(site, "fakehelper", version="1.0",
                      requires=["fakehelper-cpu==1.0; extra == 'cpu'", "fakehelper-gpu==1.0; extra == 'gpu'"],
                      extras=["cpu", "gpu"])
    if not broken:
        make_distribution(site, "fakehelper-cpu", version="1.0")
    return site


def _fake_checks(site: Path) -> list[doctor_cmd.DependencyCheck]:
    checks = check_dependencies([str(site), *sys.path])
    return [c for c in checks if c.dependent.startswith(("soup-plugin-fake", "fakehelper"))]


def test_missing_and_out_of_range_dependencies_fail_with_one_fix_line(tmp_path) -> None:
    checks = _fake_checks(fake_site(tmp_path, broken=True))
    status = {(c.dependent, c.name): (c.status, c.required) for c in checks}
    assert status == {
        ("soup-plugin-fake", "soup-core"): (OK, True),
        ("soup-plugin-fake", "definitely-not-installed-dep"): (MISSING, True),
        ("soup-plugin-fake", "pluggy"): (OUT_OF_RANGE, True),
        ("soup-plugin-fake", "nothere"): (NOT_APPLICABLE, False),
        ("soup-plugin-fake[plot]", "plotlib-nope"): (OPTIONAL, False),
        ("soup-plugin-fake", "fakehelper"): (OK, True),
        ("fakehelper[cpu]", "fakehelper-cpu"): (MISSING, True),  # the extra a soup plugin asks for
    }
    assert fix_command(checks) == 'pip install "definitely-not-installed-dep>=1" "pluggy<1" "fakehelper-cpu==1.0"'


def test_control_a_complete_site_has_no_failure(tmp_path) -> None:
    checks = _fake_checks(fake_site(tmp_path, broken=False))
    assert [c for c in checks if c.failed] == [] and fix_command(checks) is None
    assert {c.name for c in checks if c.status == OK} >= {"soup-core", "pluggy", "fakehelper", "fakehelper-cpu"}


def test_the_fix_line_merges_the_ranges_of_one_package() -> None:
    def check(dependent: str, spec: str, extras: tuple[str, ...] = ()) -> doctor_cmd.DependencyCheck:
        return doctor_cmd.DependencyCheck(dependent, "torch", spec, extras, True, "2.0", OUT_OF_RANGE, "")

    line = fix_command([check("soup-core[train]", ">=2.4"), check("soup-plugin-x", "<3,>=2.4", ("cpu",))])
    assert line == 'pip install "torch[cpu]>=2.4,<3"'


def test_soup_core_requirements_are_read_from_its_installed_metadata() -> None:
    """What doctor checks for soup-core is what the root pyproject.toml declares (the dev install's metadata
    is rebuilt by scripts/install whenever a pyproject changes)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {re.sub(r"[-_.]+", "-", parse_requirement(d).name).lower() for d in project["dependencies"]}
    for deps in project["optional-dependencies"].values():
        declared |= {re.sub(r"[-_.]+", "-", parse_requirement(d).name).lower() for d in deps}
    seen = {re.sub(r"[-_.]+", "-", c.name).lower() for c in check_dependencies()
            if c.dependent.split("[")[0] == "soup-core"}
    assert seen == declared, "the installed soup-core metadata is stale: run bash scripts/install"


def test_doctor_exits_1_with_the_fix_line(tmp_path) -> None:
    site = fake_site(tmp_path, broken=True)
    proc = run_soup(["doctor", "--quick"], extra_path=[site], env={"COLUMNS": "200"}, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fix = re.search(r"^Fix: (pip install .+)$", proc.stdout, re.M)
    assert fix and '"definitely-not-installed-dep>=1"' in fix.group(1) and '"pluggy<1"' in fix.group(1)
    assert "definitely-not-installed-dep >=1 (required by soup-plugin-fake): not installed" in proc.stdout
    as_json = run_soup(["doctor", "--quick", "--json"], extra_path=[site], timeout=300)
    report = json.loads(as_json.stdout)
    assert as_json.returncode == 1 and report["ok"] is False and "definitely-not-installed-dep>=1" in report["fix"]
    assert "soup-plugin-fake" in {d["name"] for d in report["distributions"]}
    assert {p["name"]: p["status"] for p in report["plugins"]}["fake"] == "ok"


def test_control_doctor_does_not_blame_a_complete_fake_site(tmp_path) -> None:
    site = fake_site(tmp_path, broken=False)
    report = json.loads(run_soup(["doctor", "--quick", "--json"], extra_path=[site], timeout=300).stdout)
    assert not [d for d in report["dependencies"] if d["dependent"].startswith(("soup-plugin-fake", "fakehelper"))
                and d["required"] and d["status"] != OK]


def test_cuda_bf16_is_asked_without_emulation(monkeypatch) -> None:
    """On a machine without a GPU, a stand-in torch.cuda records how doctor asks (a lent GPU shows the rest)."""
    torch = pytest.importorskip("torch")
    asked: list[tuple[int, dict]] = []
    current = {"index": 0}

    @contextlib.contextmanager
    def device(index: int):
        current["index"] = index
        yield

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append((current["index"], {"including_emulation": including_emulation}))
        return current["index"] == 0 or including_emulation  # device 1 only emulates bf16

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        name=f"GPU{i}", major=8 - i * 1, minor=0, total_memory=80 * 2**30))
    cuda = doctor_cmd.device_report()["cuda"]
    assert asked == [(0, {"including_emulation": False}), (1, {"including_emulation": False})]
    assert [(d["name"], d["capability"], d["bf16"]) for d in cuda["devices"]] == [("GPU0", "8.0", True),
                                                                                  ("GPU1", "7.0", False)]
    lines = doctor_cmd._device_lines({"cpu": {"cores": 2, "machine": "x"}, "cuda": cuda, "mps": {}, "mlx": {}})
    assert "bf16: no (not without emulation)" in lines[2]


def test_devices_on_this_cpu_machine() -> None:
    pytest.importorskip("torch")
    devices = doctor_cmd.device_report()
    assert devices["cpu"]["cores"] >= 1 and devices["cpu"]["threads"] >= 1
    import torch

    assert devices["cuda"]["available"] is torch.cuda.is_available()
    if not devices["cuda"]["available"]:
        assert devices["cuda"]["reason"]


def test_doctor_is_a_core_command_and_imports_light() -> None:
    code = ("import sys; import soup_core.default_plugins.commands.doctor_cmd; "
            "print(sorted(m for m in ('torch', 'transformers', 'packaging', 'mlx') if m in sys.modules))")
    proc = run_soup([], timeout=60)  # the help lists the command
    assert "doctor" in proc.stdout + proc.stderr
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
