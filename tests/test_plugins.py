"""The plugin manager: built-ins, duplicates, isolation of failures, selection, probes, tracing."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from soup_core import ConfigField, Probe, ProbeResult, Recorder, Support, Task, hookimpl
from soup_core.plugins import FAILED, OK, UNAVAILABLE, PluginLoadError, PluginSelectionError
from soup_core.testing import isolated_plugins, make_distribution, run_soup


def make_plugin(**hooks: object) -> types.SimpleNamespace:
    ns = types.SimpleNamespace(SOUP_HOOK_API=(1, 1))
    for name, value in hooks.items():
        setattr(ns, name, hookimpl(lambda value=value: value) if not callable(value) else hookimpl(value))
    return ns


class EchoTask(Task):
    name = "echo"
    formats = ("text",)


class OtherEchoTask(Task):
    name = "echo"


def test_builtins_register_through_the_same_hooks() -> None:
    plugins = isolated_plugins()
    assert all(info.builtin for info in plugins.plugins.values())
    assert "plugins" in plugins.commands and plugins.commands.owner("plugins") == "core.cli"


def test_duplicate_task_names_both_plugins_and_leaves_no_trace() -> None:
    first = make_plugin(soup_register_tasks=[EchoTask])
    second = make_plugin(soup_register_tasks=[OtherEchoTask],
                         soup_register_config_fields=[ConfigField("training.echo_level", int, 1)])
    plugins = isolated_plugins(("first", first), ("second", second))
    assert plugins.plugins["first"].status == OK
    info = plugins.plugins["second"]
    assert info.status == FAILED
    assert "'first'" in info.reason and "'second'" in info.reason
    assert plugins.tasks["echo"] is EchoTask
    assert "training.echo_level" not in plugins.config_fields  # rolled back with the plugin
    with pytest.raises(PluginLoadError):
        isolated_plugins(("first", first), ("second", second), strict=True)


def test_duplicate_config_field_is_refused() -> None:
    a = make_plugin(soup_register_config_fields=[ConfigField("training.shared", int, 1)])
    b = make_plugin(soup_register_config_fields=[ConfigField("training.shared", int, 2)])
    plugins = isolated_plugins(("a", a), ("b", b))
    assert plugins.plugins["b"].status == FAILED and "config field 'training.shared'" in plugins.plugins["b"].reason


def test_raising_registration_and_bad_hook_api_are_isolated() -> None:
    def boom() -> list:
        raise RuntimeError("kaboom")

    raising = make_plugin(soup_register_tasks=boom)
    future = types.SimpleNamespace(SOUP_HOOK_API=(2, 3))
    undeclared = types.SimpleNamespace()
    good = make_plugin(soup_register_tasks=[EchoTask])
    plugins = isolated_plugins(("raising", raising), ("future", future), ("undeclared", undeclared),
                               ("good", good))
    assert plugins.plugins["raising"].status == FAILED and "kaboom" in plugins.plugins["raising"].reason
    assert plugins.plugins["future"].status == FAILED and "2..3" in plugins.plugins["future"].reason
    assert plugins.plugins["undeclared"].status == FAILED
    assert plugins.plugins["good"].status == OK and "echo" in plugins.tasks


def test_cheap_probe_failure_makes_the_plugin_unavailable_and_refuses_runs() -> None:
    probe = Probe("needs-thing", lambda: ProbeResult(False, "thing is missing", "pip install thing"))
    plugin = make_plugin(soup_register_tasks=[EchoTask], soup_register_probes=[probe])
    plugins = isolated_plugins(("needy", plugin))
    info = plugins.plugins["needy"]
    assert (info.status, info.reason, info.fix) == (UNAVAILABLE, "thing is missing", "pip install thing")
    problems = plugins.requirements_for(backend="transformers", task="echo")
    assert problems and "thing is missing" in problems[0] and "pip install thing" in problems[0]


def test_deep_probe_runs_only_when_asked_and_scoped_probes_gate_one_task() -> None:
    calls: list[str] = []

    def deep() -> ProbeResult:
        calls.append("deep")
        return ProbeResult(False, "constructor lacks loss_type", "pip install -U trl")

    plugin = make_plugin(soup_register_tasks=[EchoTask],
                         soup_register_probes=[Probe("deep", deep, deep=True, scope="task:echo")])
    plugins = isolated_plugins(("deepy", plugin))
    assert calls == [] and plugins.plugins["deepy"].status == OK
    assert "loss_type" in plugins.requirements_for(backend="transformers", task="echo")[0]
    plugins.deep_check()
    assert "task:echo" in plugins.unavailable_scopes


def test_probe_helpers_ask_the_object_not_the_version() -> None:
    from soup_core.probes import accepts

    class WithoutLossType:
        def __init__(self, beta: float = 0.1) -> None: ...

    class WithLossType(WithoutLossType):
        def __init__(self, beta: float = 0.1, loss_type: str = "grpo") -> None: ...

    class Shim(WithLossType):
        def __init__(self, *args, **kwargs) -> None:  # a deprecation passthrough
            super().__init__(*args, **kwargs)

    assert not accepts(WithoutLossType, "loss_type")
    assert accepts(WithLossType, "loss_type")
    assert accepts(Shim, "loss_type")


def test_support_rows_from_several_plugins_merge() -> None:
    a = make_plugin(soup_register_support=[Support("transformers", "echo", frozenset({"training.a"}))])
    b = make_plugin(soup_register_support=[Support("transformers", "echo", frozenset({"training.b"}))])
    plugins = isolated_plugins(("a", a), ("b", b))
    assert plugins.support[("transformers", "echo")] == {"training.a", "training.b"}


class CapableTask(Task):
    name = "capable"
    capabilities = frozenset({"shiny"})


def test_a_capability_row_reaches_only_supported_tasks_that_declare_it() -> None:
    tasks = make_plugin(
        soup_register_tasks=[EchoTask, CapableTask],
        soup_register_support=[
            Support("transformers", "echo", frozenset({"training.a"})),
            Support("transformers", "capable", frozenset({"training.a"})),
        ],
    )
    extra = make_plugin(
        soup_register_support=[Support("transformers", "*", frozenset({"training.x"}), capability="shiny")]
    )
    plugins = isolated_plugins(("extra", extra), ("tasks", tasks))  # order-independent: resolved on query
    assert plugins.support[("transformers", "capable")] == {"training.a", "training.x"}
    assert plugins.support[("transformers", "echo")] == {"training.a"}  # control: no capability, no field
    assert ("transformers", "*") not in plugins.support
    assert not any(task == "capable" for backend, task in plugins.support if backend == "mlx")


def test_a_row_for_every_task_must_name_a_capability() -> None:
    bad = make_plugin(soup_register_support=[Support("transformers", "*", frozenset({"training.x"}))])
    plugins = isolated_plugins(("bad", bad))
    assert plugins.plugins["bad"].status == FAILED
    assert "needs a capability" in plugins.plugins["bad"].reason


def test_selection_errors_name_the_installed_plugins() -> None:
    from soup_core.plugins import build_plugin_set

    good = make_plugin(soup_register_tasks=[EchoTask])
    with pytest.raises(PluginSelectionError, match="installed plugins: good"):
        build_plugin_set(extra=[("good", good)], entry_points=False, disabled=["nosuch"])
    with pytest.raises(PluginSelectionError, match="built-in"):
        build_plugin_set(extra=[("good", good)], entry_points=False, disabled=["core.cli"])
    plugins = build_plugin_set(extra=[("good", good)], entry_points=False, load_only=[])
    assert plugins.plugins["good"].status == "disabled" and "echo" not in plugins.tasks


def test_recorder_that_raises_is_reported_once_and_disabled() -> None:
    from soup_core.events import MicroBatch
    from soup_core.run_events import ControllerError, RunEvents

    class Broken(Recorder):
        name = "broken"

        def on_micro_batch(self, event: MicroBatch) -> None:
            raise OSError("disk full")

    class Counting(Recorder):
        name = "counting"
        seen = 0

        def on_micro_batch(self, event: MicroBatch) -> None:
            self.seen += 1

    messages: list[str] = []
    counting = Counting()
    events = RunEvents(recorders=[(Broken(), "brokenplugin"), (counting, "ok")], report=messages.append)
    for step in range(3):
        events.micro_batch(MicroBatch(step=step + 1, micro=0, rows=(0,), row_loss=(1.0,), row_tokens=(3,)))
    assert counting.seen == 3
    assert len(messages) == 1 and "brokenplugin" in messages[0] and "disk full" in messages[0]

    class BadController:
        name = "bad"

        def on_step(self, event):  # noqa: ANN001
            raise ValueError("nope")

    from soup_core.events import OptimizerStep

    loud = RunEvents(controllers=[(BadController(), "ctrlplugin")])
    with pytest.raises(ControllerError, match="ctrlplugin"):
        loud.optimizer_step(OptimizerStep(step=1))


def test_firstresult_model_loading_names_the_answering_plugin(monkeypatch, capsys) -> None:
    class Loaded:
        loaded_by = ""

    def decline(config, backend, task):  # noqa: ANN001
        return None

    def answer(config, backend, task):  # noqa: ANN001
        return Loaded()

    monkeypatch.setenv("SOUP_TRACE_HOOKS", "1")
    plugins = isolated_plugins(("decliner", make_plugin(soup_load_model=decline)),
                               ("answerer", make_plugin(soup_load_model=answer)))
    result, by = plugins.call_load_model(config=None, backend="x", task=None)
    assert isinstance(result, Loaded) and by == "answerer"
    assert "soup_load_model: answerer answered" in capsys.readouterr().err


BROKEN = {"broken_plugin.py": "import not_a_module_that_exists\n"}
INCOMPATIBLE = {
    "needs_gpu_plugin.py": """
        from soup_core import Probe, ProbeResult, hookimpl
        SOUP_HOOK_API = (1, 1)

        @hookimpl
        def soup_register_probes():
            return [Probe("gpu", lambda: ProbeResult(False, "no CUDA device", "run on a GPU machine"))]
    """
}


def test_broken_and_incompatible_installed_plugins_are_listed(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_distribution(site, "soup-plugin-broken", entry_points={"broken": "broken_plugin"}, modules=BROKEN)
    make_distribution(site, "soup-plugin-needsgpu", entry_points={"needsgpu": "needs_gpu_plugin"},
                      modules=INCOMPATIBLE)
    env = {"SOUP_HOME": str(tmp_path / "home")}
    proc = run_soup(["plugins", "list", "--json"], env=env, extra_path=[site])
    assert proc.returncode == 0, proc.stderr
    listed = {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}
    assert listed["broken"]["status"] == "failed" and "not_a_module_that_exists" in listed["broken"]["reason"]
    assert listed["broken"]["distribution"] == "soup-plugin-broken"
    assert listed["needsgpu"]["status"] == "unavailable" and listed["needsgpu"]["reason"] == "no CUDA device"
    human = run_soup(["plugins", "list"], env=env, extra_path=[site])
    assert human.returncode == 0 and "no CUDA device" in human.stdout
    assert run_soup(["--version"], env=env, extra_path=[site]).returncode == 0
    strict = run_soup(["plugins", "list"], env={**env, "SOUP_STRICT_PLUGINS": "1"}, extra_path=[site])
    assert strict.returncode == 1 and "broken" in strict.stderr and "Traceback" not in strict.stderr
    disabled = run_soup(["-p", "no:broken", "plugins", "list", "--json"], env={**env, "SOUP_STRICT_PLUGINS": "1"},
                        extra_path=[site])
    assert disabled.returncode == 0, disabled.stderr
    unknown = run_soup(["-p", "no:nosuch", "plugins", "list"], env=env, extra_path=[site])
    assert unknown.returncode == 1 and "broken" in unknown.stderr


def test_discovery_loads_a_real_installed_distribution(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_distribution(site, "soup-plugin-hello", version="1.2.3", entry_points={"hello": "hello_plugin"}, modules={
        "hello_plugin.py": """
            import typer
            from soup_core import Command, hookimpl
            SOUP_HOOK_API = (1, 1)

            def hello() -> None:
                \"\"\"Say hello.\"\"\"
                typer.echo("hello from a plugin")

            @hookimpl
            def soup_register_commands():
                return [Command("hello", hello, "Say hello.")]
        """})
    env = {"SOUP_HOME": str(tmp_path / "home")}
    assert run_soup(["hello"], env=env, extra_path=[site]).stdout.strip() == "hello from a plugin"
    version = run_soup(["--version"], env=env, extra_path=[site]).stdout
    assert "hello 1.2.3" in version.splitlines()[1]
    off = run_soup(["hello"], env={**env, "SOUP_DISABLE_PLUGINS": "hello"}, extra_path=[site])
    assert off.returncode == 2  # the command is gone: a usage error
    only = run_soup(["plugins", "list", "--json"], env={**env, "SOUP_LOAD_PLUGINS": ""}, extra_path=[site])
    assert {p["name"]: p["status"] for p in json.loads(only.stdout)["plugins"]}["hello"] == "disabled"
