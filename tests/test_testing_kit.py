"""The test kit (``soup_core.testing``): light to import, and its three fixtures as a plugin author uses them —
including the example in docs/plugins.md, run as its own pytest session."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from soup_core.testing import TrainingFailed, write_jsonl

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "trl", "bitsandbytes", "datasets", "mlx", "mlx_lm", "accelerate")

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))))
"""


def heavy_after_importing(*modules: str) -> list[str]:
    """The heavy packages loaded by importing ``modules`` in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = f"HEAVY = {HEAVY!r}\n{PROBE}"
    proc = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_kit_imports_nothing_heavy() -> None:
    assert heavy_after_importing("soup_core.testing") == []


def test_control_the_probe_sees_a_heavy_import_after_the_kit() -> None:
    assert "transformers" in heavy_after_importing("soup_core.testing", "transformers")


def chat_rows(n: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                      {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}
        for i in range(n)
    ]


@pytest.fixture
def config(tmp_path: Path) -> dict:
    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    return {"data": {"train": str(data), "max_length": 64}, "training": {"max_steps": 2, "batch_size": 4}}


def test_soup_home_is_a_fresh_folder_in_the_environment(soup_home: Path) -> None:
    assert os.environ["SOUP_HOME"] == str(soup_home)
    assert soup_home.is_dir() and not any(soup_home.iterdir())
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['SOUP_HOME'])"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(soup_home)


def test_tiny_model_loads_with_the_auto_classes(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    text = tokenizer.apply_chat_template(chat_rows(1)[0]["messages"], tokenize=False)
    assert "<|assistant|>" in text and model.config.model_type == "llama"
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)


@pytest.mark.slow
def test_run_training_trains_through_soup_train_and_returns_the_events(run_training, config, tiny_model) -> None:
    from soup_core import MicroBatch, OptimizerStep, RunEnd, RunStart
    from soup_core.tracker import Tracker

    result = run_training(config, installed=False)
    kinds = [type(event) for event in result.events]
    assert kinds == [RunStart, MicroBatch, OptimizerStep, MicroBatch, OptimizerStep, RunEnd]
    assert result.status == "completed" and result.end.status == "completed"
    assert result.start.config.base == str(tiny_model)  # base defaults to the tiny model
    assert [step.step for step in result.steps] == [1, 2]
    assert sorted(r for batch in result.micro for r in batch.rows) == list(range(8))
    assert (result.output_dir / "soup_config.yaml").is_file()  # output defaults to a temporary folder
    row = Tracker().get_run(result.run_id)  # the tracker row, in the test's own SOUP_HOME
    assert row is not None and row.status == "completed"
    assert "Done. run " + result.run_id in result.output


@pytest.mark.slow
def test_a_refused_run_raises_with_soups_message(run_training, config, tmp_path: Path) -> None:
    config["data"]["train"] = str(tmp_path / "missing.jsonl")
    with pytest.raises(TrainingFailed) as failed:
        run_training(config, installed=False)
    assert failed.value.exit_code == 1 and failed.value.events == []
    assert str(tmp_path / "missing.jsonl") in str(failed.value)
    assert "error: " + failed.value.message in failed.value.output  # what soup train printed


def _stop_at_first_step_plugin():
    from soup_core import Controller, Stop, hookimpl

    class StopEarly(Controller):
        name = "stop-early"

        def on_step(self, event):
            return [Stop("enough")]

    class Plugin:
        SOUP_HOOK_API = (1, 1)

        @hookimpl
        def soup_register_controllers(self):
            return [StopEarly]

    return Plugin()


@pytest.mark.slow
def test_extra_plugins_take_part_and_replace_an_installed_one_of_their_name(run_training, config) -> None:
    pytest.importorskip("soup_plugin_rewind.plugin")
    with_rewind = run_training(config)  # the installed plugins take part: rewind writes its log
    assert (with_rewind.output_dir / "rewind.jsonl").is_file()
    stopped = run_training(config, plugins=[("rewind", _stop_at_first_step_plugin())])
    assert stopped.status == "stopped" and len(stopped.steps) == 1  # the extra plugin's controller acted
    assert not (stopped.output_dir / "rewind.jsonl").exists()  # and it took the installed rewind's place


@pytest.mark.slow
def test_a_dry_run_plans_without_training(run_training, config) -> None:
    result = run_training(config, installed=False, dry_run=True)
    assert result.status == "planned" and result.events == [] and "Dry run passed" in result.output
    assert not result.output_dir.exists()


def test_plugin_from_leaves_out_adds_and_replaces_hooks() -> None:
    from soup_core import PreflightReport, Recorder, hookimpl
    from soup_core.testing import isolated_plugins, plugin_from

    class Mine(Recorder):
        name = "mine"

    class Theirs(Recorder):
        name = "theirs"

    class Base:
        SOUP_HOOK_API = (1, 1)

        @hookimpl
        def soup_preflight(self, config):
            return PreflightReport(refusal="never")

        @hookimpl
        def soup_register_recorders(self):
            return [Mine]

    def hooked(plugins, hook: str) -> list[str]:
        return [impl.plugin_name for impl in getattr(plugins.pm.hook, hook).get_hookimpls()]

    base = isolated_plugins(("base", Base()))  # control: the base plugin as it is
    assert "base" in hooked(base, "soup_preflight") and "mine" in base.recorders
    derived = isolated_plugins(("derived", plugin_from(
        Base(), leave_out=["soup_preflight"], soup_register_recorders=lambda: [Theirs],
        soup_register_controllers=lambda: [],
    )))
    assert derived.plugins["derived"].status == "ok"
    assert "derived" not in hooked(derived, "soup_preflight")
    assert "theirs" in derived.recorders and "mine" not in derived.recorders
    assert "derived" in hooked(derived, "soup_register_controllers")


@pytest.mark.parametrize("enabled", [True, False])
def test_one_thread_is_set_before_test_modules_import_torch(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, enabled: bool
) -> None:
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
        monkeypatch.delenv(name, raising=False)
    pytester.makeconftest('pytest_plugins = ["soup_core.testing"]' if enabled else "")  # control: without it
    pytester.makepyfile(test_threads="""
        import os

        AT_IMPORT = os.environ.get("OMP_NUM_THREADS")  # what torch would read if imported here

        def test_one_thread():
            assert AT_IMPORT == "1"
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=int(enabled), failed=int(not enabled))


def docs_example() -> tuple[str, str]:
    """The conftest line and the example test of docs/plugins.md, section "4. Testing a plugin"."""
    text = (REPO / "docs" / "plugins.md").read_text(encoding="utf-8")
    section = text.split("## 4. Testing a plugin", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    conftest = next(b for b in blocks if b.startswith("# tests/conftest.py"))
    example = next(b for b in blocks if b.startswith("# tests/test_train.py"))
    return conftest, example


STAND_IN_PLUGIN = """
from soup_core import Recorder, hookimpl

SOUP_HOOK_API = (1, 1)


class Quiet(Recorder):
    name = "mine-quiet"


@hookimpl
def soup_register_recorders():
    return [Quiet]
"""


@pytest.mark.slow
def test_the_documented_example_passes_as_its_own_session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    conftest, example = docs_example()
    assert conftest.strip().splitlines()[-1] == 'pytest_plugins = ["soup_core.testing"]'  # one line enables it
    pytester.makeconftest(conftest)
    pytester.mkpydir("my_soup_plugin").joinpath("plugin.py").write_text(STAND_IN_PLUGIN, encoding="utf-8")
    pytester.syspathinsert()
    pytester.makepyfile(test_train=example, test_home="""
        import os

        def test_a_home(soup_home):
            assert os.environ["SOUP_HOME"] == str(soup_home)

        def test_restored_afterwards():
            assert os.environ.get("SOUP_HOME", "unset") == os.environ["OUTER_SOUP_HOME"]
    """)
    monkeypatch.setenv("OUTER_SOUP_HOME", os.environ.get("SOUP_HOME", "unset"))
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2 + example.count("\ndef test_"))
