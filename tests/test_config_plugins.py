"""Plugin config fields, the support table, and building a schema from a plugin set."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

import pytest

from soup_core.config import (
    ConfigError,
    ConfigSchema,
    SoupConfig,
    TrainingConfig,
    config_to_dict,
    core_field_paths,
    load_config_text,
    resolve_schema,
    validate_config,
)
from soup_core.contracts import REQUIRED, Backend, ConfigField, Task


class SftTask(Task):
    name = "sft"


class ForgetTask(Task):
    name = "forget"
    data_keys = ("data.forget",)


class TransformersBackend(Backend):
    name = "transformers"


class OtherBackend(Backend):
    name = "other"


REWIND_LOG = ConfigField("training.rewind_log", bool, True, "Write the flight-recorder log.", observer=True)
STREAM_LAYERS = ConfigField("training.stream_layers", int | None, None, "Layers kept on the GPU.")
FORGET = ConfigField("data.forget", str | None, None, "Rows to forget.")
NEW_SECTION = ConfigField("probe.level", Literal["low", "high"], "low", "A new top-level section.")

CORE = frozenset(core_field_paths())
NO_QUANT = CORE - {"training.quantization"}


def make_schema(fields: list[ConfigField] = (), owners: dict[str, str] | None = None, **kwargs) -> ConfigSchema:
    return ConfigSchema(
        fields={f.path: f for f in fields},
        field_owners=owners or {f.path: "testplug" for f in fields},
        support=kwargs.pop(
            "support",
            {("transformers", "sft"): CORE, ("other", "sft"): NO_QUANT, ("transformers", "forget"): CORE},
        ),
        backends={"transformers": TransformersBackend, "other": OtherBackend},
        tasks={"sft": SftTask, "forget": ForgetTask},
    )


GOOD = "base: tiny\ndata:\n  train: rows.jsonl\n"


def load(text: str, schema: ConfigSchema) -> SoupConfig:
    return load_config_text(text, source="soup.yaml", plugins=schema)


def errors_of(text: str, schema: ConfigSchema) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(text, schema)
    return info.value


# ---------------------------------------------------------------------------------- support table


def test_field_the_pair_does_not_honour_is_refused() -> None:
    schema = make_schema()
    error = errors_of("base: tiny\nbackend: other\ndata:\n  train: r.jsonl\ntraining:\n  quantization: 4bit\n", schema)
    assert [issue.path for issue in error.issues] == ["training.quantization"]
    assert error.issues[0].message.startswith("not honoured by backend 'other' with task 'sft'")
    assert error.issues[0].line == 6


def test_same_field_at_its_default_or_honoured_is_accepted() -> None:
    schema = make_schema()
    assert load(GOOD + "backend: other\ntraining:\n  quantization: none\n", schema).training.quantization == "none"
    assert load(GOOD + "training:\n  quantization: 4bit\n", schema).training.quantization == "4bit"


def test_a_section_in_the_row_honours_every_field_under_it() -> None:
    row = (CORE - {"training.lora.r", "training.lora.alpha"}) | {"training.lora"}
    schema = make_schema(support={("transformers", "sft"): row})
    assert load(GOOD + "training:\n  lora:\n    r: 16\n", schema).training.lora.r == 16


def test_always_honoured_fields_need_no_row_entry() -> None:
    schema = make_schema(support={("transformers", "sft"): frozenset()})
    text = "base: tiny\noutput: out\nexperiment_name: e\ndata:\n  train: r.jsonl\n  val_split: 0.1\n  seed: 3\n"
    config = load(text, schema)
    assert config.data.val_split == 0.1 and config.output == "out" and config.data.seed == 3
    error = errors_of(GOOD + "training:\n  epochs: 1\n", schema)
    assert [issue.path for issue in error.issues] == ["training.epochs"]


def test_pair_without_a_support_row_is_refused_by_name() -> None:
    schema = make_schema([FORGET])
    error = errors_of("base: tiny\nbackend: other\ntask: forget\ndata:\n  forget: f.jsonl\n", schema)
    assert [issue.path for issue in error.issues] == ["task"]
    message = error.issues[0].message
    assert "task 'forget' is not supported by backend 'other'" in message
    assert "backend 'other' supports: sft" in message


def test_observer_field_is_never_refused() -> None:
    schema = make_schema([REWIND_LOG, STREAM_LAYERS])  # neither is in any support row
    config = load(GOOD + "training:\n  rewind_log: false\n", schema)
    assert config.training.rewind_log is False
    error = errors_of(GOOD + "training:\n  rewind_log: false\n  stream_layers: 2\n", schema)
    assert [issue.path for issue in error.issues] == ["training.stream_layers"]
    assert "not honoured by backend 'transformers' with task 'sft'" in error.issues[0].message


# ---------------------------------------------------------------------------------- plugin fields


def test_plugin_fields_are_assembled_with_their_defaults() -> None:
    schema = make_schema([REWIND_LOG, NEW_SECTION])
    config = load(GOOD, schema)
    assert isinstance(config, SoupConfig) and isinstance(config.training, TrainingConfig)
    assert config.training.rewind_log is True and config.training.lora.r == 8
    assert config.probe.level == "low"
    assert config_to_dict(config)["training"]["rewind_log"] is True
    assert validate_config(config_to_dict(config), plugins=schema) == config
    assert schema.model is schema.model  # built once per schema
    assert schema.model.model_fields["training"].annotation.model_fields["rewind_log"].description


def test_plugin_fields_are_validated_strictly() -> None:
    schema = make_schema([REWIND_LOG, NEW_SECTION])
    error = errors_of(GOOD + "training:\n  rewind_log: yes\nprobe:\n  level: medium\n  lvel: 1\n", schema)
    messages = {issue.path: issue for issue in error.issues}
    assert messages["training.rewind_log"].message == "expected true or false, got 'yes'"
    assert messages["probe.level"].message.startswith("expected one of 'low' or 'high'")
    assert messages["probe.lvel"].suggestion == "probe.level"


def test_plugin_field_in_the_wrong_section_gets_a_suggestion() -> None:
    schema = make_schema([REWIND_LOG])
    error = errors_of(GOOD + "  rewind_log: true\n", schema)
    assert error.issues[0].path == "data.rewind_log" and error.issues[0].suggestion == "training.rewind_log"


def test_plugin_field_under_lora() -> None:
    field = ConfigField("training.lora.use_dora", bool, False)
    config = load(
        GOOD + "training:\n  lora:\n    use_dora: true\n",
        make_schema([field], support={("transformers", "sft"): CORE | {"training.lora.use_dora"}}),
    )
    assert config.training.lora.use_dora is True and config.training.lora.alpha == 16


def test_required_plugin_field() -> None:
    field = ConfigField("probe.key", str, REQUIRED)
    schema = make_schema([field], support={("transformers", "sft"): CORE | {"probe.key"}})
    error = errors_of(GOOD, schema)
    assert error.issues[0].path == "probe" and "required" in error.issues[0].message
    assert load(GOOD + "probe:\n  key: abc\n", schema).probe.key == "abc"


def test_task_data_keys_are_required_and_always_honoured() -> None:
    schema = make_schema([FORGET])
    error = errors_of("base: tiny\ntask: forget\n", schema)
    assert [(i.path, i.message) for i in error.issues] == [("data.forget", "required by task 'forget'")]
    config = load("base: tiny\ntask: forget\ndata:\n  forget: f.jsonl\n", schema)
    assert config.data.forget == "f.jsonl" and config.data.train is None


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("training.lora.r", "core field"),
        ("training", "core section"),
        ("data.train.extra", "'data.train' is a core field, not a section"),
    ],
)
def test_plugin_field_colliding_with_the_core_names_the_plugin(path: str, needle: str) -> None:
    with pytest.raises(ValueError, match="plugin 'badplug'") as info:
        make_schema([ConfigField(path, int, 1)], owners={path: "badplug"})
    assert needle in str(info.value)


def test_plugin_field_nested_under_another_plugins_field() -> None:
    fields = [ConfigField("training.rewind_log", bool, True), ConfigField("training.rewind_log.x", int, 1)]
    owners = {"training.rewind_log": "rewind", "training.rewind_log.x": "other"}
    with pytest.raises(ValueError, match="plugin 'other'.*field of plugin 'rewind'"):
        make_schema(fields, owners=owners)


# ---------------------------------------------------------------------------------- plugin sets


class FakeRegistry(dict):
    """The plugin manager's registry shape: a mapping with ``owner(name)``."""

    def __init__(self, items: dict, owners: dict[str, str]) -> None:
        super().__init__(items)
        self._owners = owners

    def owner(self, name: str) -> str:
        return self._owners[name]


def test_schema_from_a_plugin_set() -> None:
    plugins = SimpleNamespace(
        config_fields=FakeRegistry({REWIND_LOG.path: REWIND_LOG}, {REWIND_LOG.path: "rewind"}),
        support={("transformers", "sft"): CORE},
        backends={"transformers": TransformersBackend},
        tasks={"sft": SftTask},
    )
    schema = resolve_schema(plugins)
    assert resolve_schema(plugins) is schema  # cached per plugin set
    assert schema.owner("training.rewind_log") == "rewind"
    config = load_config_text(GOOD, plugins=plugins)
    assert config.training.rewind_log is True


def test_collision_from_a_plugin_set_names_the_plugin() -> None:
    clash = ConfigField("data.seed", int, 0)
    plugins = SimpleNamespace(
        config_fields=FakeRegistry({clash.path: clash}, {clash.path: "seedy"}),
        support={},
        backends={},
        tasks={},
    )
    with pytest.raises(ValueError, match="plugin 'seedy' declares config field 'data.seed', which is a core field"):
        ConfigSchema.from_plugins(plugins)


def test_a_type_named_as_module_attr_is_imported_only_when_a_config_is_validated(tmp_path, monkeypatch) -> None:
    import sys

    (tmp_path / "lazy_soup_types.py").write_text(
        "from typing import Annotated\n"
        "from pydantic import Field\n"
        "Buffers = Annotated[int, Field(ge=2, le=8)]\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    field = ConfigField("training.buffers", "lazy_soup_types:Buffers", 2, "Buffers.")
    schema = make_schema(
        [field], support={("transformers", "sft"): CORE | {"training.buffers"}}
    )
    assert "lazy_soup_types" not in sys.modules
    config = load_config_text("base: m\ndata: {train: t.jsonl}\ntraining: {buffers: 4}\n", plugins=schema)
    assert config.training.buffers == 4 and "lazy_soup_types" in sys.modules
    with pytest.raises(ConfigError, match="training.buffers"):  # control: the named type's bound holds
        load_config_text("base: m\ndata: {train: t.jsonl}\ntraining: {buffers: 1}\n", plugins=schema)


def test_a_type_name_that_cannot_be_imported_names_the_plugin() -> None:
    schema = make_schema([ConfigField("training.buffers", "no_such_module_here:Type", 2, "Buffers.")])
    with pytest.raises(ValueError, match="plugin 'testplug' gives config field 'training.buffers' the type"):
        _ = schema.model


def test_a_pair_may_say_why_it_leaves_a_field_out() -> None:
    reasons = {("other", "sft"): {"training.quantization": "this engine has no quantised kernels"}}
    schema = ConfigSchema(
        support={("transformers", "sft"): CORE, ("other", "sft"): NO_QUANT},
        backends={"transformers": TransformersBackend, "other": OtherBackend},
        tasks={"sft": SftTask},
        support_reasons=reasons,
    )
    text = "base: m\nbackend: other\ndata: {train: t.jsonl}\ntraining: {quantization: 4bit}\n"
    with pytest.raises(ConfigError) as error:
        load_config_text(text, plugins=schema)
    (issue,) = error.value.issues
    assert issue.message.startswith(
        "not honoured by backend 'other' with task 'sft': this engine has no quantised kernels (remove it"
    ), issue.message
