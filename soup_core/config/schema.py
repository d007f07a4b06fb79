"""The core config models (docs/config.md) and :class:`ConfigSchema`, which adds plugin fields to them.

Every model forbids unknown keys and validates strictly: a bool is ``true``/``false`` only, an integer
is never a float or a bool, a number is never a bool. Plugin fields are added with
``pydantic.create_model`` as subclasses of the core models, so an assembled config is still a
:class:`SoupConfig` and code written against the core fields keeps working.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationInfo, create_model, field_validator

from soup_core.contracts import REQUIRED, ConfigField

ROOT_SECTION = ""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _check_target_modules(value: Any) -> Literal["auto"] | list[str]:
    if value == "auto" and isinstance(value, str):
        return "auto"
    if not isinstance(value, list):
        shown = f"'{value}'" if isinstance(value, str) else type(value).__name__
        raise ValueError(f"expected 'auto' or a list of module names, got {shown}")
    if not value:
        raise ValueError("the list of module names is empty (use 'auto' to let Soup choose)")
    bad = [item for item in value if not isinstance(item, str) or not item.strip()]
    if bad:
        raise ValueError(f"every module name must be a non-empty string, got {bad[0]!r}")
    return list(value)


TargetModules = Annotated[Literal["auto"] | list[str], PlainValidator(_check_target_modules)]


def _check_files(value: Any) -> str | list[str | dict[str, Any]] | None:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"expected a path or a list of files, got {type(value).__name__}")
    if not value:
        raise ValueError("the list of files is empty")
    from soup_core.data.build import entry_problem

    for i, entry in enumerate(value):
        problem = entry_problem(entry)
        if problem:  # "[2].weight: ..." becomes the path data.train[2].weight (validate._translate)
            raise ValueError(f"[{i}]{problem}")
    return [dict(entry) if isinstance(entry, dict) else entry for entry in value]


#: A path, or a list of files: each a path or a mapping {path, format, weight} (docs/config.md).
DataFiles = Annotated[str | list[str | dict[str, Any]] | None, PlainValidator(_check_files)]


class LoraConfig(_Section):
    r: int = Field(8, ge=0, description="LoRA rank; 0 trains every weight (full fine-tuning).")
    alpha: int = Field(16, ge=1, description="LoRA scaling numerator (the update is scaled by alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: TargetModules = Field(
        "auto", description="'auto' (the backend picks the layers) or a list of module names."
    )


class DataConfig(_Section):
    train: DataFiles = Field(None, description="The training data: a .jsonl/.json/.csv file, or a list of files.")
    format: str = Field("auto", description="Row format name, or 'auto' to detect it from the rows.")
    val_split: float = Field(0.0, ge=0, le=0.5, description="Fraction of rows held out for validation.")
    seed: int = Field(42, description="Seed for the split and for the order of rows in every epoch.")
    max_length: int = Field(1024, ge=8, le=1048576, description="Tokens per example; longer are truncated.")
    train_on_responses_only: bool = Field(True, description="Compute the loss on assistant tokens only.")
    on_bad_row: Literal["error", "skip"] = Field("error", description="Stop at a malformed row, or skip it.")
    packing: bool = Field(False, description="Pack several short examples into one sequence.")


class TrainingConfig(_Section):
    epochs: int = Field(3, ge=1, description="Passes over the training rows.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    batch_size: int = Field(4, ge=1, description="Rows per micro-batch (per device).")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear", description="Learning-rate schedule."
    )
    warmup_ratio: float = Field(
        0.0, ge=0, le=0.5, description="Fraction of steps spent warming up (not with scheduler constant)."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm (0 disables clipping).")
    seed: int = Field(42, description="Seed for weight initialisation and dropout.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype; 'auto' lets the backend choose for the hardware."
    )
    quantization: Literal["none", "4bit", "8bit"] = Field("none", description="Load the base model quantised.")
    bnb_4bit_use_double_quant: bool = Field(True, description="Quantise the 4-bit quantisation constants.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations to save memory.")
    sharding: Literal["none", "fsdp", "zero2", "zero3"] = Field(
        "none", description="Shard the model over the processes: FSDP2, or DeepSpeed ZeRO stage 2/3."
    )
    cpu_offload: bool = Field(False, description="With sharding: keep parameters and optimizer state on the CPU.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="The adapter.")
    save_steps: int | None = Field(None, ge=1, description="Save a checkpoint every N steps.")
    save_total_limit: int | None = Field(
        None, ge=1, description="Keep only the newest N checkpoints (never the one resumed from); unset keeps all."
    )
    eval_steps: int | None = Field(None, ge=1, description="Evaluate on the validation rows every N steps.")
    logging_steps: int = Field(10, ge=1, description="Log metrics every N steps.")
    resume_from: str | None = Field(None, description="A checkpoint folder to resume from.")
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Extra trackers to report metrics to."
    )

    @field_validator("warmup_ratio")
    @classmethod
    def _warmup_needs_a_schedule_that_warms_up(cls, value: float, info: ValidationInfo) -> float:
        if value and info.data.get("scheduler") == "constant":
            raise ValueError(
                f"scheduler constant has no warmup, so warmup_ratio {value} would be ignored; use "
                "scheduler: constant_with_warmup, or warmup_ratio: 0"
            )
        return value


class SoupConfig(_Section):
    base: str = Field(..., min_length=1, description="The model to fine-tune: a Hugging Face id or a folder.")
    task: str = Field("sft", description="The training task.")
    backend: str = Field("transformers", description="The training engine.")
    output: str = Field("./output", description="Output root folder.")
    experiment_name: str | None = Field(None, description="Optional run sub-folder under output.")
    data: DataConfig = Field(default_factory=DataConfig, description="The training data.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="The optimisation.")

    @field_validator("experiment_name")
    @classmethod
    def _plain_folder_name(cls, value: str | None) -> str | None:
        if value is None:
            return value
        bad = [ch for ch in ("/", "\\", ":", "\0") if ch in value]
        if bad:
            raise ValueError(f"must be a plain folder name; {bad[0]!r} is not allowed")
        if value.strip() in ("", ".", ".."):
            raise ValueError(f"must be a plain folder name, got {value!r}")
        return value


# Handled by the core itself, whatever the backend and task: never refused by the support table.
ALWAYS_HONOURED = frozenset({"base", "task", "backend", "output", "experiment_name", "data.train", "data.format",
                             "data.val_split", "data.seed", "data.on_bad_row"})


def section_class(annotation: Any) -> type[BaseModel] | None:
    """The model class of a section field, or None for a leaf."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def iter_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any, type[BaseModel] | None]]:
    """Every field of ``model`` by full path, depth first: (path, FieldInfo, section class or None)."""
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        section = section_class(info.annotation)
        yield path, info, section
        if section is not None:
            yield from iter_fields(section, path)


def core_field_paths() -> list[str]:
    """Every leaf path of the core schema (sections excluded), in definition order."""
    return [path for path, _, section in iter_fields(SoupConfig) if section is None]


class ConfigSchema:
    """The config schema: the core models plus what plugins registered.

    ``fields``: plugin config fields by path; ``field_owners``: path -> plugin name (for messages);
    ``support``: (backend, task) -> the field paths that pair honours; ``backends``/``tasks``: the
    registered names and classes. The assembled pydantic model is built once, on first use.
    """

    def __init__(
        self,
        fields: Mapping[str, ConfigField] | None = None,
        field_owners: Mapping[str, str] | None = None,
        support: Mapping[tuple[str, str], frozenset[str]] | None = None,
        backends: Mapping[str, type] | None = None,
        tasks: Mapping[str, type] | None = None,
        support_reasons: Mapping[tuple[str, str], Mapping[str, str]] | None = None,
        not_loaded: Sequence[tuple[str, str, str]] = (),
    ) -> None:
        self.fields: dict[str, ConfigField] = dict(fields or {})
        self.field_owners: dict[str, str] = dict(field_owners or {})
        self.support: dict[tuple[str, str], frozenset[str]] = {
            pair: frozenset(paths) for pair, paths in (support or {}).items()
        }
        self.backends: dict[str, type] = dict(backends or {})
        self.tasks: dict[str, type] = dict(tasks or {})
        self.support_reasons: dict[tuple[str, str], dict[str, str]] = {
            pair: dict(reasons) for pair, reasons in (support_reasons or {}).items()
        }
        #: installed plugins that are disabled or failed: (plugin, distribution, why), for messages
        self.not_loaded = list(not_loaded)
        self._check_paths()
        self._model: type[SoupConfig] | None = None
        self._index: dict[str, tuple[Any, type[BaseModel] | None]] | None = None

    @classmethod
    def from_plugins(cls, plugins: Any) -> ConfigSchema:
        """Build from a plugin set: its ``config_fields`` (with ``owner()``), ``support``, ``backends``
        and ``tasks``."""
        fields = plugins.config_fields
        owners = {path: plugins.config_fields.owner(path) for path in fields}
        reasons = getattr(plugins, "support_reasons", None)
        absent = [(p.name, p.distribution, f"{p.status}: {p.reason}" if p.status == "failed" else p.reason)
                  for p in (plugins.not_loaded() if hasattr(plugins, "not_loaded") else ())]
        return cls(fields, owners, plugins.support, plugins.backends, plugins.tasks, reasons, absent)

    def owner(self, path: str) -> str:
        return self.field_owners.get(path, "<unknown plugin>")

    def _check_paths(self) -> None:
        """Refuse a plugin path that collides with a core field or section, or nests under a leaf."""
        core = {path: section for path, _, section in iter_fields(SoupConfig)}
        for path, config_field in self.fields.items():
            plugin = f"plugin {self.owner(path)!r}"
            if config_field.path != path:
                raise ValueError(f"{plugin} registered config field {config_field.path!r} under the key {path!r}")
            parts = path.split(".")
            if not all(part.isidentifier() for part in parts):
                raise ValueError(f"{plugin} declares an invalid config path {path!r}")
            declares = f"{plugin} declares config field {path!r}"
            if path in core:
                kind = "section" if core[path] is not None else "field"
                raise ValueError(f"{declares}, which is a core {kind}; a plugin must use a new name")
            for i in range(1, len(parts)):
                ancestor = ".".join(parts[:i])
                if ancestor in core and core[ancestor] is None:
                    raise ValueError(f"{declares}, but {ancestor!r} is a core field, not a section")
                if ancestor in self.fields:
                    owner = self.owner(ancestor)
                    raise ValueError(f"{declares}, but {ancestor!r} is a field of plugin {owner!r}, not a section")

    # --------------------------------------------------------------------------------- the model

    @property
    def model(self) -> type[SoupConfig]:
        """The assembled pydantic model (a subclass of :class:`SoupConfig` when plugins add fields)."""
        if self._model is None:
            tree: dict[str, Any] = {}
            for path, config_field in self.fields.items():
                node = tree
                *parents, leaf = path.split(".")
                for part in parents:
                    node = node.setdefault(part, {})
                node[leaf] = config_field._replace(annotation=self._annotation(path, config_field.annotation))
            self._model = _assemble(SoupConfig, "SoupConfig", tree) if tree else SoupConfig
        return self._model

    def _annotation(self, path: str, annotation: Any) -> Any:
        """A ``"module:attr"`` annotation imported now: plugins name types built with pydantic that way, so
        that registering their fields at every start imports nothing."""
        if not isinstance(annotation, str):
            return annotation
        module, _, attr = annotation.partition(":")
        try:
            value: Any = importlib.import_module(module)
            for part in attr.split("."):
                value = getattr(value, part)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(
                f"plugin {self.owner(path)!r} gives config field {path!r} the type {annotation!r}, which "
                f"cannot be imported ({type(exc).__name__}: {exc}); report this to the plugin's author"
            ) from exc
        return value

    def _fields_index(self) -> dict[str, tuple[Any, type[BaseModel] | None]]:
        if self._index is None:
            self._index = {path: (info, section) for path, info, section in iter_fields(self.model)}
        return self._index

    def paths(self, *, sections: bool = False) -> list[str]:
        """Every valid path of the assembled schema (leaves; and sections too if asked)."""
        return [p for p, (_, s) in self._fields_index().items() if sections or s is None]

    def section_keys(self, prefix: str) -> list[str]:
        """The valid keys directly under section ``prefix`` ('' for the top level)."""
        if prefix == ROOT_SECTION:
            return list(self.model.model_fields)
        entry = self._fields_index().get(prefix)
        if entry is None or entry[1] is None:
            return []
        return list(entry[1].model_fields)

    def is_section(self, path: str) -> bool:
        entry = self._fields_index().get(path)
        return entry is not None and entry[1] is not None

    def field_info(self, path: str) -> Any:
        return self._fields_index()[path][0]

    def default(self, path: str) -> Any:
        """The default of leaf ``path``; :data:`REQUIRED` for a required field."""
        info = self.field_info(path)
        if info.is_required():
            return REQUIRED
        return info.get_default(call_default_factory=True)

    def is_observer(self, path: str) -> bool:
        config_field = self.fields.get(path)
        return bool(config_field is not None and config_field.observer)


def _assemble(base: type[BaseModel], name: str, tree: Mapping[str, Any]) -> Any:
    """A subclass of ``base`` (or a new section when ``base`` is None) with the plugin fields in ``tree``."""
    definitions: dict[str, Any] = {}
    for key, node in tree.items():
        if isinstance(node, ConfigField):
            default = node.default
            if default is REQUIRED:
                spec = Field(..., description=node.description)
            elif isinstance(default, (list, dict, set)):
                spec = Field(default_factory=lambda d=default: copy.deepcopy(d), description=node.description)
            else:
                spec = Field(default, description=node.description)
            definitions[key] = (node.annotation, spec)
            continue
        existing = base.model_fields.get(key) if base is not None else None
        parent = section_class(existing.annotation) if existing is not None else None
        section = _assemble(parent or _Section, f"{key.title().replace('_', '')}Config", node)
        description = existing.description if existing is not None else f"Section {key}."
        if _has_required(node):  # a section holding a required field must itself be given
            definitions[key] = (section, Field(..., description=description))
        else:
            definitions[key] = (section, Field(default_factory=section, description=description))
    return create_model(name, __base__=base, **definitions)


def _has_required(tree: Mapping[str, Any]) -> bool:
    return any(
        (node.default is REQUIRED) if isinstance(node, ConfigField) else _has_required(node) for node in tree.values()
    )
