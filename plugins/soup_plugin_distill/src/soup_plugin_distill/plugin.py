"""The ``distill`` plugin's hooks: the task, its config fields and support row, probes and the pre-flight.

Import-light (this module is imported at every CLI start): pydantic is imported when a config is validated
(the field types are named in :mod:`soup_plugin_distill.field_types`), torch/transformers/trl only when
a run builds the trainer.
"""

from __future__ import annotations

from typing import Any

from soup_core import ConfigField, PreflightReport, Probe, ProbeResult, Support, hookimpl, probes

#: Hook-API versions this plugin supports (min, max).
SOUP_HOOK_API = (1, 1)

TASK = "distill"
DEFAULT_DIVERGENCE = "forward_kl"
DEFAULT_TEMPERATURE = 2.0
DEFAULT_WEIGHT = 0.5
#: The fields this plugin adds, all honoured by (transformers, distill) and by no other pair.
FIELDS = (
    "training.teacher_model",
    "training.distill_divergence",
    "training.distill_temperature",
    "training.distill_weight",
)
_FIX_TRAIN = 'pip install "soup-core[train]"'


@hookimpl
def soup_register_tasks() -> list[type]:
    from soup_plugin_distill.task import DistillTask

    return [DistillTask]


#: pydantic-built types, named so that registering the fields at every start imports nothing
_TYPES = "soup_plugin_distill.field_types:"


@hookimpl
def soup_register_config_fields() -> list[ConfigField]:
    from typing import Literal

    from soup_plugin_distill.bounds import TEMPERATURE_RANGE, WEIGHT_RANGE

    low_t, high_t = TEMPERATURE_RANGE
    low_w, high_w = WEIGHT_RANGE
    return [
        ConfigField(
            "training.teacher_model",
            _TYPES + "TeacherModel",
            None,
            "task distill: the teacher to distil from, a local model folder, a .gguf file or a hub id; it must "
            "share the student's tokenizer (required for task distill, refused for other tasks).",
        ),
        ConfigField(
            "training.distill_divergence",
            Literal["forward_kl", "reverse_kl", "js"],
            DEFAULT_DIVERGENCE,
            "task distill: forward_kl = KL(teacher||student), mode-covering; "
            "reverse_kl = KL(student||teacher), "
            "mode-seeking; js = Jensen-Shannon, symmetric and bounded.",
        ),
        ConfigField(
            "training.distill_temperature",
            _TYPES + "Temperature",
            DEFAULT_TEMPERATURE,
            f"task distill: softmax temperature T ({low_t:g}..{high_t:g}) for both models; the divergence is "
            "scaled by T^2.",
        ),
        ConfigField(
            "training.distill_weight",
            _TYPES + "Weight",
            DEFAULT_WEIGHT,
            "task distill: loss = (1 - w) * cross-entropy + w * T^2 * divergence; 0 is plain sft, 1 is "
            "distillation alone.",
        ),
    ]


@hookimpl
def soup_register_support() -> list[Support]:
    # a frozenset in the backend module; importing it stays light
    from soup_core.default_plugins.transformers import HONOURED_FIELDS

    return [Support(backend="transformers", task=TASK, fields=frozenset(HONOURED_FIELDS) | frozenset(FIELDS))]


# ---------------------------------------------------------------------------------------------- probes


def _stack_installed() -> ProbeResult:
    for dist in ("torch", "transformers", "trl"):
        result = probes.distribution(dist, fix=_FIX_TRAIN)
        if not result.ok:
            return result
    return ProbeResult(True, detail="torch, transformers and trl installed")


def _trainer_seams() -> ProbeResult:
    """Deep: the installed Trainer reads ``loss_is_scaled_for_ga`` (how the distillation loss tells it that
    gradient accumulation is already accounted for) and the core's mixin has the seams overridden here."""
    from transformers import Trainer

    from soup_core.default_plugins.transformers import SoupTrainerMixin

    if not hasattr(Trainer, "loss_is_scaled_for_ga"):
        return ProbeResult(
            False,
            "the installed transformers Trainer has no loss_is_scaled_for_ga, so gradient accumulation "
            "of the "
            "distillation loss could be scaled twice",
            "pip install 'transformers>=5.24,<6'",
        )
    for attr in ("soup_row_losses", "soup_step_metrics", "from_setup"):
        if not probes.has_attribute(SoupTrainerMixin, attr):
            return ProbeResult(
                False, f"soup-core's SoupTrainerMixin has no {attr}", "pip install -U soup-core"
            )
    return ProbeResult(True)


@hookimpl
def soup_register_probes() -> list[Probe]:
    return [
        Probe("training stack installed", _stack_installed, deep=False, scope=f"task:{TASK}"),
        Probe("trainer seams", _trainer_seams, deep=True, scope=f"task:{TASK}"),
    ]


# ------------------------------------------------------------------------------------------- pre-flight


@hookimpl
def soup_preflight(config: Any) -> PreflightReport | None:
    if getattr(config, "task", None) != TASK:
        return None  # the support table refuses distill fields set for another task
    from soup_plugin_distill.teacher import (
        MISSING_TOKENIZER_FIX,
        TOKENIZER_FILES,
        config_vocab_size,
        local_folder,
        looks_local,
        missing_tokenizer_message,
        vocab_mismatch_message,
    )

    t = config.training
    teacher = t.teacher_model
    title = "distillation"
    if not teacher:
        return PreflightReport(
            title=title,
            refusal="task distill needs training.teacher_model: the model to distil from",
            fix="set training.teacher_model to a model folder or hub id that shares the student's tokenizer",
        )
    from soup_core.default_plugins.transformers import inspect_base

    inspected = inspect_base(teacher, what="training.teacher_model")  # a GGUF teacher: its header
    if inspected is not None and inspected[1]:
        return PreflightReport(title=title, refusal=inspected[1])
    folder = None if inspected is not None else local_folder(teacher)
    if inspected is None and looks_local(teacher) and (folder is None or not folder.is_dir()):
        return PreflightReport(
            title=title,
            refusal=f"training.teacher_model: model folder {teacher!r} does not exist",
            fix="give the folder of a trained model (paths are relative to where you run soup), or a hub id",
        )
    teacher_size, student_size = config_vocab_size(teacher), config_vocab_size(str(config.base))
    if teacher_size is not None and student_size is not None and teacher_size != student_size:
        return PreflightReport(
            title=title,
            refusal=vocab_mismatch_message(teacher, teacher_size, str(config.base), student_size),
            fix="choose a teacher with the student's tokenizer, or a student of the teacher's family",
        )
    if folder is not None and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return PreflightReport(
            title=title, refusal=missing_tokenizer_message(teacher), fix=MISSING_TOKENIZER_FIX
        )
    w, temperature = float(t.distill_weight), float(t.distill_temperature)
    return PreflightReport(
        title=title,
        lines=[
            f"teacher: {teacher} (frozen, loaded once)",
            f"loss = {1 - w:g}·CE + {w:g}·T²·{t.distill_divergence} with T = {temperature:g}",
        ],
    )
