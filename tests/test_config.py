"""The config loader: core schema, unknown keys with suggestions, error rendering, YAML problems."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from soup_core.config import (
    ConfigError,
    ConfigSchema,
    SoupConfig,
    config_to_dict,
    core_field_paths,
    dump_config_yaml,
    is_default,
    known,
    load_config,
    load_config_text,
    validate_config,
)
from soup_core.contracts import Backend, Task


class SftTask(Task):
    name = "sft"
    data_keys = ("data.train",)


class TransformersBackend(Backend):
    name = "transformers"


def core_schema(**extra: object) -> ConfigSchema:
    """The core registrations as the built-in plugin gives them: transformers/sft honour every core field."""
    kwargs: dict = {
        "support": {("transformers", "sft"): frozenset(core_field_paths())},
        "backends": {"transformers": TransformersBackend},
        "tasks": {"sft": SftTask},
    }
    kwargs.update(extra)
    return ConfigSchema(**kwargs)


SCHEMA = core_schema()
GOOD = "base: tiny-model\ndata:\n  train: rows.jsonl\n"


def errors_of(text: str, schema: ConfigSchema = SCHEMA, **kwargs: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config_text(text, source="soup.yaml", plugins=schema, **kwargs)
    return info.value


def issue_at(error: ConfigError, path: str):
    matches = [issue for issue in error.issues if issue.path == path]
    assert matches, f"no issue at {path}: {error}"
    return matches[0]


@pytest.fixture
def plugins_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first-party plugins may be installed in a dev environment; these tests are about a user who
    # has not installed them.
    monkeypatch.setattr(known, "version_of", lambda distribution: None)


# --------------------------------------------------------------------------------------- valid configs


def test_minimal_config_gets_every_default() -> None:
    config = load_config_text(GOOD, plugins=SCHEMA)
    assert isinstance(config, SoupConfig)
    assert config.base == "tiny-model" and config.task == "sft" and config.backend == "transformers"
    assert config.output == "./output" and config.experiment_name is None
    assert config.data.train == "rows.jsonl" and config.data.format == "auto" and config.data.max_length == 1024
    assert config.data.on_bad_row == "error" and config.data.train_on_responses_only is True
    t = config.training
    assert (t.epochs, t.max_steps, t.learning_rate, t.batch_size) == (3, None, 2e-4, 4)
    assert (t.scheduler, t.dtype, t.quantization, t.report_to) == ("linear", "auto", "none", [])
    assert (t.lora.r, t.lora.alpha, t.lora.dropout, t.lora.target_modules) == (8, 16, 0.05, "auto")


def test_exponent_without_dot_is_a_number() -> None:
    # PyYAML's YAML 1.1 reads `1e-4` as a string; a learning rate written that way must still work.
    config = load_config_text(GOOD + "training:\n  learning_rate: 1e-4\n  weight_decay: 5E-2\n", plugins=SCHEMA)
    assert config.training.learning_rate == 1e-4 and config.training.weight_decay == 0.05


def test_empty_section_is_all_defaults() -> None:
    config = load_config_text(GOOD + "training:\n  # nothing yet\n", plugins=SCHEMA)
    assert config.training.epochs == 3


def test_load_config_reads_a_file(tmp_path) -> None:
    path = tmp_path / "soup.yaml"
    path.write_text(GOOD + "training:\n  lora:\n    target_modules: [q_proj, v_proj]\n", encoding="utf-8")
    config = load_config(path, plugins=SCHEMA)
    assert config.training.lora.target_modules == ["q_proj", "v_proj"]


def test_missing_file_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml", plugins=SCHEMA)
    assert "file not found" in str(info.value) and "nope.yaml" in str(info.value)


# ---------------------------------------------------------------------------------------- unknown keys


def test_top_level_typo_suggests_the_key() -> None:
    error = errors_of("bse: tiny\ndata:\n  train: rows.jsonl\n")
    issue = issue_at(error, "bse")
    assert issue.suggestion == "base" and issue.line == 1
    assert "bse: unknown key — did you mean base?" in str(error)
    assert issue_at(error, "base").message == "required, but not given"


def test_nested_typo_suggests_the_full_path() -> None:
    error = errors_of(GOOD + "training:\n  learnin_rate: 0.001\n  lora:\n    alhpa: 32\n")
    assert issue_at(error, "training.learnin_rate").suggestion == "training.learning_rate"
    assert issue_at(error, "training.lora.alhpa").suggestion == "training.lora.alpha"
    assert "  training.learnin_rate: unknown key — did you mean training.learning_rate? (line 5)" in str(error)


def test_key_in_the_wrong_section_suggests_the_other_section() -> None:
    error = errors_of(GOOD + "training:\n  max_length: 2048\n")
    assert issue_at(error, "training.max_length").suggestion == "data.max_length"
    assert "did you mean data.max_length?" in str(error)


def test_section_name_typo() -> None:
    error = errors_of(GOOD + "trainig:\n  epochs: 1\n")
    assert issue_at(error, "trainig").suggestion == "training"


def test_key_of_an_uninstalled_plugin_gives_the_install_command(plugins_not_installed: None) -> None:
    error = errors_of(GOOD + "training:\n  stream_layers: 4\n  reward_hack_window: 3\n")
    stream = issue_at(error, "training.stream_layers")
    assert stream.install == "pip install soup-plugin-streaming"
    assert "soup-plugin-streaming), which is not installed" in stream.message
    assert issue_at(error, "training.reward_hack_window").install == "pip install soup-plugin-rl"
    assert "install: pip install soup-plugin-streaming" in str(error)


def test_key_of_an_installed_but_unloaded_plugin_has_no_install_command(monkeypatch) -> None:
    monkeypatch.setattr(known, "version_of", lambda distribution: "1.0")
    error = errors_of("base: tiny\ndata:\n  train: rows.jsonl\n  forget: f.jsonl\n")
    forget = issue_at(error, "data.forget")
    assert forget.install is None and "installed but not loaded" in forget.message


def test_version_of_reads_distribution_metadata() -> None:
    assert known.version_of("pydantic") is not None
    assert known.version_of("soup-plugin-that-does-not-exist") is None


def test_unknown_backend_and_task_have_distinct_messages(plugins_not_installed: None) -> None:
    mlx = issue_at(errors_of(GOOD + "backend: mlx\n"), "backend")
    assert mlx.install == "pip install soup-plugin-mlx" and "backend 'mlx'" in mlx.message
    other = issue_at(errors_of(GOOD + "backend: jax\n"), "backend")
    assert other.message.startswith("unknown backend 'jax'") and "registered backends: transformers" in other.message
    task = issue_at(errors_of(GOOD + "task: summarise\n"), "task")
    assert task.message.startswith("unknown task 'summarise'") and "registered tasks: sft" in task.message
    dpo = issue_at(errors_of(GOOD + "task: dpo\n"), "task")
    assert dpo.install == "pip install soup-plugin-rl"


def test_every_error_is_reported_at_once() -> None:
    text = (
        "base: tiny\nexperiment_name: a/b\ndata:\n  train: rows.jsonl\n  val_split: 0.9\n"
        "training:\n  epochs: 0\n  batch_size: four\n  scheduler: cosin\n  learnin_rate: 1\n"
    )
    error = errors_of(text)
    paths = [issue.path for issue in error.issues]
    assert paths == [
        "experiment_name",
        "data.val_split",
        "training.epochs",
        "training.batch_size",
        "training.scheduler",
        "training.learnin_rate",
    ]
    rendered = str(error)
    assert rendered.splitlines()[0] == "soup.yaml: 6 errors"
    assert "training.batch_size: expected an integer, got 'four'" in rendered
    assert "training.epochs: must be at least 1, got 0" in rendered
    assert "data.val_split: must be at most 0.5, got 0.9" in rendered
    assert "did you mean 'cosine'?" in rendered
    assert "Traceback" not in rendered and "pydantic" not in rendered.lower()


# ---------------------------------------------------------------------------------------- YAML problems


def test_yaml_syntax_error_has_line_and_column() -> None:
    error = errors_of("base: tiny\ndata:\n  train: rows.jsonl\n   val_split: 0.1: x\n")
    issue = error.issues[0]
    assert issue.path == "<root>" and issue.line == 4 and issue.column is not None
    assert str(error).splitlines()[1].startswith(f"  soup.yaml line 4, column {issue.column}: invalid YAML")


def test_tab_indentation_is_explained() -> None:
    error = errors_of("base: tiny\ntraining:\n\tepochs: 3\n")
    assert error.issues[0].line == 3 and "spaces, not tabs" in error.issues[0].message


def test_duplicate_key_is_refused_with_both_lines() -> None:
    error = errors_of("base: tiny\ndata:\n  train: a.jsonl\n  seed: 1\n  seed: 2\n")
    issue = issue_at(error, "data.seed")
    assert issue.line == 5 and "first set on line 4" in issue.message


def test_document_that_is_not_a_mapping() -> None:
    error = errors_of("- base: tiny\n")
    assert len(error.issues) == 1 and "must be a mapping" in error.issues[0].message
    with pytest.raises(ConfigError, match="must be a mapping"):
        validate_config(["base"], plugins=SCHEMA)  # type: ignore[arg-type]


def test_empty_file() -> None:
    for text in ("", "# only a comment\n"):
        error = errors_of(text)
        assert len(error.issues) == 1 and "empty" in error.issues[0].message


def test_several_documents_in_one_file() -> None:
    error = errors_of(GOOD + "---\nbase: other\n")
    assert error.issues[0].line == 4 and "single document" in error.issues[0].message


# ------------------------------------------------------------------------------------------ wrong types


@pytest.mark.parametrize(
    ("snippet", "path", "expected"),
    [
        ("data:\n  train: r.jsonl\n  packing: yes\n", "data.packing", "expected true or false, got 'yes'"),
        ("data:\n  train: r.jsonl\n  packing: 1\n", "data.packing", "expected true or false, got 1"),
        (
            "data:\n  train: r.jsonl\ntraining:\n  epochs: 2.5\n",
            "training.epochs",
            "expected an integer, got 2.5",
        ),
        (
            "data:\n  train: r.jsonl\ntraining:\n  epochs: true\n",
            "training.epochs",
            "expected an integer, got true",
        ),
        (
            "data:\n  train: r.jsonl\ntraining:\n  learning_rate: true\n",
            "training.learning_rate",
            "expected a number, got true",
        ),
        (
            "data:\n  train: r.jsonl\ntraining: 5\n",
            "training",
            "expected a mapping (a section of keys), got 5",
        ),
        ("data:\n  train: 3\n", "data.train", "expected a path or a list of files, got int"),
        ("data:\n  train: [a, {path: b, weight: 0}]\n", "data.train[1].weight", "must be > 0, got 0"),
        ("data:\n  train: [a, {path: b, weight: true}]\n", "data.train[1].weight", "expected a number, got True"),
        ("data:\n  train: [a, {path: b, fromat: chat}]\n", "data.train[1].fromat", "unknown key"),
        ("data:\n  train: [a, {format: chat}]\n", "data.train[1].path", "required"),
        ("data:\n  train: []\n", "data.train", "the list of files is empty"),
        (
            "data:\n  train: r.jsonl\n  on_bad_row: ignore\n",
            "data.on_bad_row",
            "expected one of 'error' or 'skip'",
        ),
    ],
)
def test_wrong_types_say_what_was_expected(snippet: str, path: str, expected: str) -> None:
    issue = issue_at(errors_of("base: tiny\n" + snippet), path)
    assert issue.message.startswith(expected), issue.message


def test_ints_accept_whole_numbers_and_floats_accept_ints() -> None:
    config = load_config_text(GOOD + "training:\n  learning_rate: 1\n  max_grad_norm: 0\n", plugins=SCHEMA)
    assert config.training.learning_rate == 1.0 and isinstance(config.training.learning_rate, float)


def test_target_modules_must_be_non_empty_strings() -> None:
    assert (
        "empty"
        in issue_at(
            errors_of(GOOD + "training:\n  lora:\n    target_modules: []\n"), "training.lora.target_modules"
        ).message
    )
    bad = errors_of(GOOD + "training:\n  lora:\n    target_modules: [q_proj, '']\n")
    assert "non-empty string" in issue_at(bad, "training.lora.target_modules").message
    assert (
        "'auto' or a list"
        in issue_at(
            errors_of(GOOD + "training:\n  lora:\n    target_modules: all\n"), "training.lora.target_modules"
        ).message
    )


@pytest.mark.parametrize("name", ["a/b", "a\\b", "c:d", "x\0y", "..", ""])
def test_experiment_name_must_be_a_plain_folder_name(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({"base": "m", "data": {"train": "r"}, "experiment_name": name}, plugins=SCHEMA)
    assert [issue.path for issue in info.value.issues] == ["experiment_name"]


def test_report_to_item_error_names_the_index() -> None:
    error = errors_of(GOOD + "training:\n  report_to: [wandb, wandbb]\n")
    issue = issue_at(error, "training.report_to[1]")
    assert issue.line == 5 and "did you mean 'wandb'?" in issue.message


def test_data_train_is_required_by_sft() -> None:
    error = errors_of("base: tiny\n")
    assert issue_at(error, "data.train").message == "required by task 'sft'"


def test_validate_config_never_leaks_a_pydantic_error() -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({"base": 3, "data": {"train": "r", 7: 1}}, plugins=SCHEMA)
    assert {issue.path for issue in info.value.issues} == {"base", "data.7"}
    assert info.value.source == "<mapping>"


# --------------------------------------------------------------------------------- overrides, output


def test_overrides_are_applied_before_validation() -> None:
    config = load_config_text(
        GOOD + "training:\n  learning_rate: 0.1\n",
        plugins=SCHEMA,
        overrides={"training.learning_rate": 1e-3, "training.lora.r": 0, "experiment_name": "run1"},
    )
    assert config.training.learning_rate == 1e-3 and config.training.lora.r == 0
    assert config.experiment_name == "run1"


def test_bad_override_is_reported_like_a_key() -> None:
    error = errors_of(GOOD, overrides={"training.learning_rate": -1.0, "training.lerning_rate": 1.0})
    assert issue_at(error, "training.learning_rate").message == "must be greater than 0, got -1.0"
    assert issue_at(error, "training.lerning_rate").suggestion == "training.learning_rate"
    override_into_leaf = errors_of(GOOD, overrides={"base.x": 1})
    assert "not a section" in issue_at(override_into_leaf, "base.x").message


def test_config_to_dict_round_trips() -> None:
    config = load_config_text(
        GOOD + "experiment_name: e1\ntraining:\n  report_to: [tensorboard]\n  lora:\n    target_modules: [q]\n",
        plugins=SCHEMA,
    )
    data = config_to_dict(config)
    json.dumps(data)  # JSON-safe
    assert data["training"]["lora"]["target_modules"] == ["q"] and data["data"]["seed"] == 42
    assert validate_config(data, plugins=SCHEMA) == config
    assert load_config_text(dump_config_yaml(config), plugins=SCHEMA) == config


def test_is_default() -> None:
    config = load_config_text(GOOD + "training:\n  epochs: 3\n  batch_size: 8\n", plugins=SCHEMA)
    assert is_default(config, "training.epochs") and not is_default(config, "training.batch_size")
    assert is_default(config, "training.lora") and not is_default(config, "base")


def test_documented_error_example_is_what_soup_prints(monkeypatch) -> None:
    monkeypatch.setattr(known, "version_of", lambda distribution: None)
    text = (
        "base: tiny\nbackend: mlx\ndata:\n  train: rows.jsonl\ntraining:\n"
        "  learnin_rate: 0.001\n  max_length: 2048\n  batch_size: four\n"
    )
    rendered = str(errors_of(text))
    doc = (Path(__file__).resolve().parent.parent / "docs" / "config.md").read_text(encoding="utf-8")
    example = doc.split("```text\n", 1)[1].split("```", 1)[0].rstrip("\n")
    assert rendered == example


def test_config_error_survives_pickling() -> None:
    import pickle

    error = errors_of("bse: tiny\n")
    copy = pickle.loads(pickle.dumps(error))
    assert copy.issues == error.issues and copy.source == "soup.yaml" and str(copy) == str(error)


def test_warmup_with_a_schedule_that_has_none_is_refused() -> None:
    snippet = "training:\n  scheduler: constant\n  warmup_ratio: 0.1\n"
    issue = issue_at(errors_of(GOOD + snippet), "training.warmup_ratio")
    assert "would be ignored" in issue.message and "constant_with_warmup" in issue.message
    # controls: the same warmup with a schedule that warms up, and constant without warmup, are fine
    load_config_text(GOOD + "training:\n  scheduler: constant_with_warmup\n  warmup_ratio: 0.1\n", plugins=SCHEMA)
    load_config_text(GOOD + "training:\n  scheduler: constant\n", plugins=SCHEMA)
