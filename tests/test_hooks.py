"""One test per hookspec, each named ``test_hook_<hook>``, exercising the hook through the real plugin
manager; a meta-test fails when a hookspec has no such test or no section of its own in docs/plugins.md
(with controls that show both checks can fail)."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

from soup_core import (
    Backend,
    Command,
    ConfigField,
    Controller,
    DataFormat,
    PreflightReport,
    Probe,
    ProbeResult,
    Recorder,
    Support,
    Task,
    hookimpl,
    hookspecs,
)
from soup_core.testing import isolated_plugins

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def plugin(**hooks: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(SOUP_HOOK_API=(1, 1), **{name: hookimpl(f) for name, f in hooks.items()})


class HookBackend(Backend):
    name = "hook_backend"


class HookTask(Task):
    name = "hook_task"
    capabilities = frozenset({"hookable"})


class HookRecorder(Recorder):
    name = "hook_recorder"


class HookController(Controller):
    name = "hook_controller"


def test_hook_soup_register_backends() -> None:
    plugins = isolated_plugins(("mine", plugin(soup_register_backends=lambda: [HookBackend])))
    assert plugins.backends["hook_backend"] is HookBackend and plugins.backends.owner("hook_backend") == "mine"


def test_hook_soup_register_tasks() -> None:
    plugins = isolated_plugins(("mine", plugin(soup_register_tasks=lambda: [HookTask])))
    assert plugins.tasks["hook_task"] is HookTask


def test_hook_soup_register_data_formats() -> None:
    shout = DataFormat("shout", ("shout",), lambda r: "shout" in r, lambda r: {"text": r["shout"].upper()})
    plugins = isolated_plugins(("mine", plugin(soup_register_data_formats=lambda: [shout])))
    assert plugins.data_formats["shout"].to_example({"shout": "hi"}) == {"text": "HI"}
    assert plugins.plugins["mine"].provides == {"data formats": ["shout"]}


def test_hook_soup_register_recorders() -> None:
    plugins = isolated_plugins(("mine", plugin(soup_register_recorders=lambda: [HookRecorder])))
    assert plugins.recorders["hook_recorder"] is HookRecorder


def test_hook_soup_register_controllers() -> None:
    plugins = isolated_plugins(("mine", plugin(soup_register_controllers=lambda: [HookController])))
    assert plugins.controllers["hook_controller"] is HookController


def test_hook_soup_register_commands() -> None:
    plugins = isolated_plugins(("mine", plugin(soup_register_commands=lambda: [Command("hook-hello", print)])))
    assert plugins.commands["hook-hello"].target is print and plugins.commands.owner("plugins") == "core.cli"


def test_hook_soup_register_export_targets() -> None:
    from soup_core.contracts import ExportTarget

    target = ExportTarget("hook-format", print, "hook-format: prints")
    plugins = isolated_plugins(("mine", plugin(soup_register_export_targets=lambda: [target])))
    assert plugins.export_targets["hook-format"] is target and plugins.export_targets.owner("hook-format") == "mine"
    assert plugins.plugins["mine"].provides == {"export targets": ["hook-format"]}


def test_hook_soup_register_config_fields() -> None:
    from soup_core.config import load_config_text

    field = ConfigField("training.hook_level", int, 1, "A level.")
    plugins = isolated_plugins(("mine", plugin(soup_register_config_fields=lambda: [field])))
    assert plugins.config_fields["training.hook_level"] is field
    config = load_config_text("base: m\ndata: {train: t.jsonl}\n", plugins=plugins)
    assert config.training.hook_level == 1


def test_hook_soup_register_support() -> None:
    rows = [Support("hook_backend", "hook_task", frozenset({"training.epochs"})),
            Support("hook_backend", "*", frozenset({"training.hook_level"}), capability="hookable")]
    plugins = isolated_plugins(("mine", plugin(soup_register_backends=lambda: [HookBackend],
                                               soup_register_tasks=lambda: [HookTask],
                                               soup_register_support=lambda: rows)))
    assert plugins.support[("hook_backend", "hook_task")] == {"training.epochs", "training.hook_level"}


def test_hook_soup_register_probes() -> None:
    probes = [Probe("has a widget", lambda: ProbeResult(False, "no widget", "pip install widget"), scope="task:x"),
              Probe("deep check", lambda: ProbeResult(True, detail="deep ok"), deep=True)]
    plugins = isolated_plugins(("mine", plugin(soup_register_probes=lambda: probes)))
    assert plugins.unavailable_scopes["task:x"] == ("mine", ProbeResult(False, "no widget", "pip install widget"))
    assert plugins.deep_check()["mine"][0][1].detail == "deep ok"


def test_hook_soup_load_model() -> None:
    plugins = isolated_plugins(("first", plugin(soup_load_model=lambda backend: None)),
                               ("second", plugin(soup_load_model=lambda config, task: ("model", config))))
    assert plugins.call_load_model(config="cfg", backend="b", task=None) == (("model", "cfg"), "second")


def test_hook_soup_preflight() -> None:
    report = PreflightReport(lines=["ok"], refusal="too big", fix="use less")
    plugins = isolated_plugins(("mine", plugin(soup_preflight=lambda config: report)))
    assert plugins.call_preflight(config=None) == [("mine", report)]


def test_hook_soup_train_elsewhere() -> None:
    # firstresult: a plugin that does not serve the options passes (None); the first that answers wins
    plugins = isolated_plugins(("first", plugin(soup_train_elsewhere=lambda options: 3 if options["cloud"] else None)),
                               ("second", plugin(soup_train_elsewhere=lambda config_path: None)))
    assert plugins.pm.hook.soup_train_elsewhere(config_path="soup.yaml", options={"cloud": True}) == 3
    assert plugins.pm.hook.soup_train_elsewhere(config_path="soup.yaml", options={"cloud": False}) is None


def test_hook_soup_run_end() -> None:
    from soup_core.run import _run_end

    seen: list[tuple] = []

    def observe(run_id, status, exception):
        seen.append((run_id, status, exception))
        return [f"said for {run_id}"]

    def broken(status):
        raise OSError("disk full")

    said: list[str] = []
    error = ValueError("boom")
    plugins = isolated_plugins(("mine", plugin(soup_run_end=observe)), ("other", plugin(soup_run_end=broken)))
    lines = _run_end(plugins, {"run_id": "r1", "output_dir": "/tmp/x"}, "failed", error, said.append)
    assert lines == ["said for r1"] and seen == [("r1", "failed", error)]
    assert said == ["plugin 'other' failed at the run's end: OSError: disk full"]  # named; the others still said


# ---------------------------------------------------------------------------------------- meta-tests


def hook_names() -> list[str]:
    return sorted(n for n, f in vars(hookspecs).items() if n.startswith("soup_") and callable(f))


def hooks_without_a_test(names: list[str], source: str) -> list[str]:
    tests = {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
    return [name for name in names if f"test_hook_{name}" not in tests]


def hooks_without_a_section(names: list[str], text: str) -> list[str]:
    headings = re.findall(r"^#+ .*?`(soup_[a-z_]+)", text, re.M)
    return [name for name in names if name not in headings]


def test_every_hookspec_has_a_test() -> None:
    assert hook_names() and hooks_without_a_test(hook_names(), Path(__file__).read_text(encoding="utf-8")) == []


def test_control_a_hookspec_without_a_test_is_found() -> None:
    source = Path(__file__).read_text(encoding="utf-8").replace("def test_hook_soup_preflight", "def preflight")
    assert hooks_without_a_test(hook_names(), source) == ["soup_preflight"]


def test_every_hookspec_has_a_section_in_the_docs() -> None:
    assert hooks_without_a_section(hook_names(), DOC.read_text(encoding="utf-8")) == []


def test_control_a_hookspec_without_a_section_is_found() -> None:
    text = re.sub(r"^(#+ .*?)`soup_load_model", r"\1`load_model", DOC.read_text(encoding="utf-8"), flags=re.M)
    assert hooks_without_a_section(hook_names(), text) == ["soup_load_model"]
