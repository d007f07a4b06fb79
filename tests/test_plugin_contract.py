"""The plugin contract on pluggy: misspelt hooks fail their plugin, implementations take any subset of a
hook's arguments, disabled and failed plugins are named where their names are missing, probes answer for
classes and functions, one tracer."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from soup_core import PreflightReport, Task, hookimpl, probes
from soup_core.plugins import DISABLED, FAILED, OK
from soup_core.testing import isolated_plugins, make_distribution, run_soup


def plugin(**hooks: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(SOUP_HOOK_API=(1, 1), **{name: hookimpl(f) for name, f in hooks.items()})


class MisspeltTask(Task):
    name = "misspelt"


# ------------------------------------------------------------------------------------ misspelt hooks


def test_a_misspelt_hook_fails_its_plugin_naming_the_hook_and_the_right_one() -> None:
    plugins = isolated_plugins(("typo", plugin(soup_register_task=lambda: [MisspeltTask])))
    info = plugins.plugins["typo"]
    assert info.status == FAILED
    assert "hook 'soup_register_task' matches no hookspec" in info.reason
    assert "did you mean 'soup_register_tasks'?" in info.reason
    assert "misspelt" not in plugins.tasks
    assert plugins.pm.get_plugin("typo") is None  # unregistered: nothing half-registered stays


def test_control_the_same_hook_spelt_right_registers() -> None:
    plugins = isolated_plugins(("typo", plugin(soup_register_tasks=lambda: [MisspeltTask])))
    assert plugins.plugins["typo"].status == OK and plugins.tasks.owner("misspelt") == "typo"


def test_an_optional_hook_for_a_later_core_is_allowed() -> None:
    later = types.SimpleNamespace(SOUP_HOOK_API=(1, 1),
                                  soup_register_widgets=hookimpl(optionalhook=True)(lambda: ["w"]))
    assert isolated_plugins(("later", later)).plugins["later"].status == OK


def test_a_misspelt_hook_in_an_installed_plugin_is_listed_failed(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_distribution(site, "soup-plugin-typo", entry_points={"typo": "typo_plugin"}, modules={"typo_plugin.py": """
        from soup_core import Command, hookimpl
        SOUP_HOOK_API = (1, 1)

        @hookimpl
        def soup_register_command():
            return [Command("typo", lambda: None, "never registered")]
    """})
    proc = run_soup(["plugins", "list", "--json"], env={"SOUP_HOME": str(tmp_path / "home")}, extra_path=[site])
    assert proc.returncode == 0, proc.stderr
    typo = {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}["typo"]
    assert typo["status"] == FAILED and "did you mean 'soup_register_commands'?" in typo["reason"]


# ------------------------------------------------------------------------- any subset of the arguments

PREFLIGHT_PLUGIN = """
    from soup_core import PreflightReport, hookimpl
    SOUP_HOOK_API = (1, 1)

    @hookimpl
    def soup_preflight():
        return PreflightReport(lines=["checked by a pre-flight that takes no arguments"])
"""


def _dry_run_site(tmp_path: Path, model: Path) -> tuple[Path, Path]:
    site = tmp_path / "site"
    make_distribution(site, "soup-plugin-noargs", entry_points={"noargs": "noargs_plugin"},
                      modules={"noargs_plugin.py": PREFLIGHT_PLUGIN})
    (tmp_path / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n" for i in range(4)), encoding="utf-8")
    config = tmp_path / "soup.yaml"
    config.write_text(f"base: {model}\noutput: {tmp_path / 'out'}\ndata:\n  train: train.jsonl\n",
                      encoding="utf-8")
    return site, config


def test_a_preflight_that_takes_no_parameters_works_in_a_dry_run(tmp_path: Path, tiny_model: Path) -> None:
    site, config = _dry_run_site(tmp_path, tiny_model)
    proc = run_soup(["train", "--dry-run", "-c", str(config)], env={"SOUP_HOME": str(tmp_path / "home")},
                    extra_path=[site], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checked by a pre-flight that takes no arguments" in proc.stdout + proc.stderr


def test_control_without_the_plugin_the_line_is_absent(tmp_path: Path, tiny_model: Path) -> None:
    site, config = _dry_run_site(tmp_path, tiny_model)
    proc = run_soup(["-p", "no:noargs", "train", "--dry-run", "-c", str(config)],
                    env={"SOUP_HOME": str(tmp_path / "home")}, extra_path=[site], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checked by a pre-flight" not in proc.stdout + proc.stderr


def test_implementations_take_any_subset_of_the_spec_arguments() -> None:
    seen: list[object] = []
    plugins = isolated_plugins(
        ("none", plugin(soup_preflight=lambda: PreflightReport(lines=["none"]))),
        ("config", plugin(soup_preflight=lambda config: seen.append(config))),
        ("task_only", plugin(soup_load_model=lambda task: None)),
        ("backend", plugin(soup_load_model=lambda backend: f"loaded for {backend}")),
    )
    assert [(p, r.lines) for p, r in plugins.call_preflight("the config")] == [("none", ["none"])]
    assert seen == ["the config"]
    assert plugins.call_load_model(config=None, backend="x", task=None) == ("loaded for x", "backend")


def test_control_a_raising_preflight_is_pinned_on_its_plugin() -> None:
    def boom() -> None:
        raise ValueError("nope")

    plugins = isolated_plugins(("boom", plugin(soup_preflight=boom)))
    with pytest.raises(RuntimeError, match="plugin 'boom' failed in its pre-flight check: ValueError: nope"):
        plugins.call_preflight(None)


# --------------------------------------------------------------- disabled and failed plugins are named

TASK_PLUGIN = """
    from pathlib import Path
    Path(__file__).with_name("imported.flag").write_text("imported")
    from soup_core import ConfigField, Support, Task, hookimpl
    SOUP_HOOK_API = (1, 1)

    class Shout(Task):
        name = "shout"

    @hookimpl
    def soup_register_tasks():
        return [Shout]

    @hookimpl
    def soup_register_config_fields():
        return [ConfigField("training.shout_volume", int, 1, "How loud.")]

    @hookimpl
    def soup_register_support():
        return [Support("transformers", "shout", frozenset({"training.shout_volume"}))]
"""


def _shout_site(tmp_path: Path) -> tuple[Path, Path]:
    site = tmp_path / "site"
    make_distribution(site, "acme-soup-shout", entry_points={"shout": "acme_shout"},
                      modules={"acme_shout.py": TASK_PLUGIN})
    (tmp_path / "train.jsonl").write_text(json.dumps({"text": "hello"}) + "\n", encoding="utf-8")
    config = tmp_path / "soup.yaml"
    config.write_text(f"base: {tmp_path / 'model'}\ntask: shout\ndata:\n  train: train.jsonl\n"
                      "training:\n  shout_volume: 3\n", encoding="utf-8")
    return site, config


@pytest.mark.parametrize(("args", "env", "why"), [
    ([], {"SOUP_DISABLE_PLUGINS": "shout"}, "disabled by SOUP_DISABLE_PLUGINS"),
    (["-p", "no:shout"], {}, "disabled by -p no:shout"),
    ([], {"SOUP_LOAD_PLUGINS": "rewind"}, "not in SOUP_LOAD_PLUGINS"),
])
def test_a_disabled_third_party_plugin_is_named_where_its_task_and_key_are_missing(
    tmp_path: Path, args: list[str], env: dict[str, str], why: str
) -> None:
    site, config = _shout_site(tmp_path)
    proc = run_soup([*args, "train", "--dry-run", "-c", str(config)], env={"SOUP_HOME": str(tmp_path / "h"), **env},
                    extra_path=[site], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out
    named = f"plugin 'shout' (acme-soup-shout): {why}"
    task_line = next(line for line in out.splitlines() if "unknown task 'shout'" in line)
    key_line = next(line for line in out.splitlines() if "shout_volume" in line and "unknown key" in line)
    assert named in task_line and named in key_line
    # the plugin that may provide it comes first, before the registered tasks and any did-you-mean
    assert task_line.index(named) < task_line.index("registered tasks")
    assert not (site / "imported.flag").exists()  # found from metadata: the disabled plugin was never imported


def test_control_the_enabled_plugin_provides_the_task(tmp_path: Path) -> None:
    site, config = _shout_site(tmp_path)
    proc = run_soup(["train", "--dry-run", "-c", str(config)], env={"SOUP_HOME": str(tmp_path / "h")},
                    extra_path=[site], cwd=tmp_path)
    assert "unknown task" not in proc.stdout + proc.stderr and "unknown key" not in proc.stdout + proc.stderr
    assert (site / "imported.flag").exists()


def test_a_failed_plugin_is_named_with_why_it_failed(tmp_path: Path) -> None:
    site, config = _shout_site(tmp_path)
    (site / "acme_shout.py").write_text("raise ImportError('needs libshout')\n", encoding="utf-8")
    proc = run_soup(["train", "--dry-run", "-c", str(config)], env={"SOUP_HOME": str(tmp_path / "h")},
                    extra_path=[site], cwd=tmp_path)
    task_line = next(ln for ln in (proc.stdout + proc.stderr).splitlines() if "unknown task 'shout'" in ln)
    assert "plugin 'shout' (acme-soup-shout): failed: import failed: ImportError: needs libshout" in task_line


def test_disabled_plugins_are_listed_with_their_distribution() -> None:
    plugins = isolated_plugins(("mine", plugin()))
    assert plugins.plugins["mine"].status == OK
    from soup_core.plugins import build_plugin_set

    off = build_plugin_set(extra=[("mine", plugin())], entry_points=False, disabled=["mine"])
    assert off.plugins["mine"].status == DISABLED and off.not_loaded() == [off.plugins["mine"]]


# -------------------------------------------------------------------------------------------- probes


class WithLossType:
    def __init__(self, loss_type: str = "grpo") -> None: ...

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None): ...  # noqa: ANN001

    def forward(self, x, **kwargs): ...  # noqa: ANN001


def test_accepts_answers_for_classes_functions_and_methods() -> None:
    assert probes.accepts(WithLossType, "loss_type") and not probes.accepts(WithLossType, "beta")
    assert probes.accepts(WithLossType.compute_loss, "model", "num_items_in_batch")
    assert not probes.accepts(WithLossType.compute_loss, "num_items_in_batch", "labels")
    assert probes.accepts(WithLossType().compute_loss, "return_outputs")  # a bound method
    assert probes.accepts(WithLossType.forward, "anything")  # **kwargs takes any keyword
    assert probes.accepts(len, "obj") is False  # positional-only: never a keyword


@pytest.mark.parametrize("thing", [42, "compute_loss", WithLossType()])
def test_control_accepts_refuses_what_is_neither_a_class_nor_a_function(thing: object) -> None:
    with pytest.raises(TypeError, match="accepts\\(\\) asks a class or a function"):
        probes.accepts(thing, "x")


# ------------------------------------------------------------------------------------------- tracing


def test_one_tracer_reports_registration_and_lifecycle_hooks(monkeypatch, capsys) -> None:
    monkeypatch.setenv("SOUP_TRACE_HOOKS", "1")
    plugins = isolated_plugins(("mine", plugin(soup_register_tasks=lambda: [MisspeltTask],
                                               soup_preflight=lambda: None)))
    plugins.call_preflight(None)
    err = capsys.readouterr().err
    assert "[hook] soup_register_tasks: mine registered 1" in err
    assert "[hook] soup_preflight: mine passed" in err


def test_control_no_trace_without_the_switch(monkeypatch, capsys) -> None:
    monkeypatch.delenv("SOUP_TRACE_HOOKS", raising=False)
    isolated_plugins(("mine", plugin(soup_register_tasks=lambda: [MisspeltTask]))).call_preflight(None)
    assert "[hook]" not in capsys.readouterr().err
