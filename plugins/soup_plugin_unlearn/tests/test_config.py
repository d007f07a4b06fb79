"""The unlearn config: fields and their defaults, ``unlearn_alpha: 0`` kept as 0, refusals of values the run
would not use (support table and pre-flight), the data keys, and registration that imports nothing heavy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml


@pytest.fixture(scope="module")
def plugins():
    from soup_core.testing import isolated_plugins
    from soup_plugin_unlearn import plugin

    return isolated_plugins(("unlearn", plugin))


def load(tmp_path: Path, plugins: Any, mapping: dict[str, Any]):
    import soup_core

    path = tmp_path / "soup.yaml"
    path.write_text(yaml.safe_dump(mapping), encoding="utf-8")
    return soup_core.load_config(path, plugins=plugins)


def issues(tmp_path: Path, plugins: Any, mapping: dict[str, Any]) -> dict[str, str]:
    import soup_core

    with pytest.raises(soup_core.ConfigError) as info:
        load(tmp_path, plugins, mapping)
    return {issue.path: issue.message for issue in info.value.issues}


def unlearn(**training: Any) -> dict[str, Any]:
    return {
        "base": "some/model",
        "task": "unlearn",
        "data": {"forget": "forget.jsonl", "retain": "retain.jsonl"},
        "training": training,
    }


def test_defaults_are_documented_values(tmp_path, plugins):
    from soup_plugin_unlearn.fields import describe, resolved

    config = load(tmp_path, plugins, unlearn())
    t = config.training
    assert (t.unlearn_method, t.unlearn_alpha, t.unlearn_beta, t.unlearn_gamma) == ("npo", None, None, 0.0)
    assert (t.unlearn_rmu_params, t.unlearn_rmu_tokens) == ("mlp", "all")
    assert (t.unlearn_rmu_layer, t.unlearn_rmu_coeff, t.unlearn_eval_steps) == (None, None, None)
    assert resolved(t) == {"method": "npo", "alpha": 2.0, "beta": 0.1}
    assert describe(resolved(t)) == "npo: β=0.1, retain weight α=2"
    simnpo = load(tmp_path, plugins, unlearn(unlearn_method="simnpo")).training
    assert resolved(simnpo) == {"method": "simnpo", "alpha": 1.0, "beta": 2.5, "gamma": 0.0}
    rmu = load(tmp_path, plugins, unlearn(unlearn_method="rmu", unlearn_rmu_layer=3)).training
    assert resolved(rmu) == {
        "method": "rmu", "alpha": 100.0, "rmu_layer": 3, "rmu_coeff": None, "rmu_params": "mlp", "rmu_tokens": "all"
    }
    assert describe(resolved(rmu)) == (
        "rmu: layer 3, c=5×mean norm, trains MLPs of layers l-2..l, averaged over all tokens, retain weight α=100"
    )
    explicit = load(tmp_path, plugins, unlearn(unlearn_method="rmu", unlearn_rmu_coeff=6.5, unlearn_alpha=1200))
    assert describe(resolved(explicit.training)) == (
        "rmu: layer middle, c=6.5, trains MLPs of layers l-2..l, averaged over all tokens, retain weight α=1200"
    )
    assert config.data.train is None  # data.train is not required by this task


def test_every_field_has_a_description_naming_its_default(plugins):
    from soup_plugin_unlearn.fields import FIELDS

    for field in FIELDS:
        assert field.description, field.path
    described = {f.path: f.description for f in FIELDS}
    assert "0.1 for npo, 2.5 for simnpo" in described["training.unlearn_beta"]
    assert "Unset: 5 × the mean norm of the steered layer's output" in described["training.unlearn_rmu_coeff"]
    assert "Unset: 2 for npo, 1 for simnpo, 100 for rmu" in described["training.unlearn_alpha"]
    assert "0 trains on the forget loss alone" in described["training.unlearn_alpha"]


def test_alpha_zero_is_zero_not_one(tmp_path, plugins):
    from soup_plugin_unlearn.fields import resolved

    t = load(tmp_path, plugins, unlearn(unlearn_alpha=0)).training
    assert t.unlearn_alpha == 0.0 and isinstance(t.unlearn_alpha, float)
    assert resolved(t)["alpha"] == 0.0
    assert resolved(load(tmp_path, plugins, unlearn(unlearn_alpha=2.5)).training)["alpha"] == 2.5


@pytest.mark.parametrize(
    ("training", "path", "words"),
    [
        ({"unlearn_alpha": -1}, "training.unlearn_alpha", "at least 0"),
        ({"unlearn_beta": 0}, "training.unlearn_beta", "greater than 0"),
        ({"unlearn_rmu_coeff": -2.0}, "training.unlearn_rmu_coeff", "greater than 0"),
        ({"unlearn_rmu_layer": -1}, "training.unlearn_rmu_layer", "at least 0"),
        ({"unlearn_method": "nop"}, "training.unlearn_method", "did you mean 'npo'"),
        ({"unlearn_alpha": True}, "training.unlearn_alpha", "a number"),
    ],
)
def test_bad_values_name_the_field(tmp_path, plugins, training, path, words):
    found = issues(tmp_path, plugins, unlearn(**training))
    assert path in found and words in found[path], found


def test_forget_is_required_by_the_task_and_train_is_not(tmp_path, plugins):
    mapping = unlearn()
    del mapping["data"]["forget"]
    assert issues(tmp_path, plugins, mapping) == {"data.forget": "required by task 'unlearn'"}


def test_retain_is_optional(tmp_path, plugins):
    mapping = unlearn()
    del mapping["data"]["retain"]
    assert load(tmp_path, plugins, mapping).data.retain is None


@pytest.mark.parametrize(
    ("extra", "path"),
    [
        ({"data": {"packing": True}}, "data.packing"),
        ({"training": {"eval_steps": 5}}, "training.eval_steps"),
    ],
)
def test_core_fields_the_unlearn_trainer_does_not_honour_are_refused(tmp_path, plugins, extra, path):
    mapping = unlearn()
    for section, values in extra.items():
        mapping[section].update(values)
    assert (
        "not honoured by backend 'transformers' with task 'unlearn'"
        in issues(tmp_path, plugins, mapping)[path]
    )


def test_unlearn_fields_are_refused_for_another_task(tmp_path, plugins):
    mapping = {"base": "m", "data": {"train": "t.jsonl"}, "training": {"unlearn_alpha": 0.5}}
    found = issues(tmp_path, plugins, mapping)
    assert "not honoured by backend 'transformers' with task 'sft'" in found["training.unlearn_alpha"]
    mapping = {"base": "m", "data": {"train": "t.jsonl"}, "training": {"unlearn_method": "npo"}}
    assert load(tmp_path, plugins, mapping).task == "sft"  # the default value is never refused


def test_the_support_row_names_only_real_core_fields():
    from soup_core.default_plugins.transformers import HONOURED_FIELDS
    from soup_plugin_unlearn.fields import CORE_FIELDS

    assert CORE_FIELDS <= HONOURED_FIELDS
    assert HONOURED_FIELDS - CORE_FIELDS == {"data.train", "data.packing", "training.eval_steps"}


@pytest.mark.parametrize(
    ("training", "data", "refusal"),
    [
        ({}, {"train": "t.jsonl"}, "data.train is set, but task unlearn does not read it"),
        ({"lora": {"r": 0}}, {}, "training.lora.r: 0 leaves no adapter to switch off"),
        (
            {"unlearn_method": "rmu", "unlearn_beta": 0.2},
            {},
            "training.unlearn_beta is used by npo and simnpo only",
        ),
        ({"unlearn_gamma": 0.5}, {}, "training.unlearn_gamma is used by simnpo only"),
        ({"unlearn_rmu_layer": 1}, {}, "training.unlearn_rmu_layer is used by rmu only"),
        (
            {"unlearn_method": "simnpo", "unlearn_rmu_coeff": 3.0},
            {},
            "training.unlearn_rmu_coeff is used by rmu only",
        ),
    ],
)
def test_preflight_refuses_values_the_run_would_not_use(tmp_path, plugins, training, data, refusal):
    from soup_plugin_unlearn.preflight import check

    mapping = unlearn(**training)
    mapping["data"].update(data)
    report = check(load(tmp_path, plugins, mapping))
    assert report.refusal and refusal in report.refusal, report
    assert report.fix


def test_preflight_plan_lines(tmp_path, plugins):
    from soup_plugin_unlearn.preflight import check

    report = check(load(tmp_path, plugins, unlearn(unlearn_method="simnpo", unlearn_gamma=0.25)))
    assert report.refusal is None and report.lines == ["method simnpo: β=2.5, γ=0.25, retain weight α=1"]
    report = check(load(tmp_path, plugins, unlearn(unlearn_alpha=0)))
    assert report.lines[-1] == "unlearn_alpha is 0: the retain rows are evaluated but not trained on"


def test_dry_run_prints_the_plan_and_refuses_through_soup_train(tmp_path, soup_train, demo_data, tiny_model):
    mapping = {
        "base": str(tiny_model),  # the dry run checks the base loads
        "task": "unlearn",
        "output": str(tmp_path / "out"),
        "data": {"forget": str(demo_data["forget"]), "retain": str(demo_data["retain"])},
        "training": {"unlearn_method": "rmu", "unlearn_rmu_coeff": 12.0},
    }
    from soup_core.testing import TrainingFailed

    ok = soup_train(mapping, dry_run=True).output
    assert "data.forget: 8 training rows" in ok and "data.retain: 16 training rows" in ok
    assert "method rmu: layer middle, c=12, trains MLPs of layers l-2..l, averaged over all tokens, " in ok
    assert "retain weight α=100" in ok
    mapping["data"]["train"] = str(demo_data["forget"])
    with pytest.raises(TrainingFailed) as refused:
        soup_train(mapping, dry_run=True)
    assert "does not read it" in refused.value.message and "remove data.train" in refused.value.message


def test_registration_imports_nothing_heavy(tmp_path):
    """Every registration hook and cheap probe runs without importing torch & co. (a fresh interpreter);
    the control imports the losses and sees torch."""
    src = Path(__file__).resolve().parents[1] / "src"
    probe = (
        "import json, sys\n"
        "from soup_plugin_unlearn import plugin as p\n"
        "p.soup_register_tasks(); p.soup_register_config_fields(); p.soup_register_support()\n"
        "p.soup_register_commands()\n"
        "[pr.check() for pr in p.soup_register_probes() if not pr.deep]\n"
        "if sys.argv[1] == 'control':\n"
        "    import soup_plugin_unlearn.losses\n"
        "heavy = {'torch', 'transformers', 'peft', 'trl', 'datasets', 'accelerate', 'bitsandbytes'}\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & heavy)))\n"
    )
    root = Path(__file__).resolve().parents[3]
    env_path = f"{src}:{root}"

    def run(mode: str) -> list[str]:
        proc = subprocess.run(
            [sys.executable, "-c", probe, mode],
            capture_output=True,
            text=True,
            timeout=180,
            env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert run("plain") == []
    assert "torch" in run("control")


@pytest.mark.parametrize(
    ("training", "expected"),
    [
        ({"lora": {"r": 4}}, "training.lora.r set, but rmu with unlearn_rmu_params: mlp"),
        ({"lora": {"target_modules": ["down_proj"]}}, "training.lora.target_modules set, but rmu with"),
        ({"quantization": "4bit"}, "training.quantization is 4bit, but rmu with unlearn_rmu_params: mlp"),
    ],
)
def test_rmu_as_published_refuses_adapter_and_quantization_settings(tmp_path, plugins, training, expected):
    from soup_plugin_unlearn.preflight import check

    report = check(load(tmp_path, plugins, unlearn(unlearn_method="rmu", **training)))
    assert report.refusal and expected in report.refusal, report.refusal
    assert "unlearn_rmu_params: lora" in report.fix
    # control: the same settings with the named LoRA setting are accepted
    ok = check(load(tmp_path, plugins, unlearn(unlearn_method="rmu", unlearn_rmu_params="lora", **training)))
    assert ok.refusal is None, ok.refusal


@pytest.mark.parametrize(("field", "value"), [("unlearn_rmu_params", "lora"), ("unlearn_rmu_tokens", "answer")])
def test_rmu_settings_are_refused_for_other_methods(tmp_path, plugins, field, value):
    from soup_plugin_unlearn.preflight import check

    report = check(load(tmp_path, plugins, unlearn(unlearn_method="npo", **{field: value})))
    assert f"training.{field} is used by rmu only" in report.refusal
