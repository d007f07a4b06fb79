"""The ``rl`` plugin: GRPO and its variants, and the preference tasks, through trl.

Registration is cheap (docs/architecture.md): nothing here imports torch or trl at module level. Deep probes
(scoped ``task:<name>``) find each task's trl classes and check what they accept; the pre-flight check
resolves the GRPO variant against the installed trl and checks the reward functions, before any data or
model is loaded (also under ``--dry-run``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from soup_core import ConfigField, DataFormat, PreflightReport, Probe, ProbeResult, Support, hookimpl, probes
from soup_plugin_rl import hack
from soup_plugin_rl.formats import FORMATS
from soup_plugin_rl.names import VARIANT_NAMES
from soup_plugin_rl.tasks import TASKS, GRPOTask, PPOTask, PreferenceTask, RLTask

#: Hook-API versions this plugin supports (min, max).
SOUP_HOOK_API = (1, 1)

TASK_NAMES = tuple(t.name for t in TASKS)
_BY_NAME = {t.name: t for t in TASKS}

GrpoVariant = Literal[VARIANT_NAMES]  # type: ignore[valid-type]


class Ge:
    """A lower bound for a numeric config field, applied by pydantic when the config is validated. (The
    ``annotated_types`` equivalent costs tens of milliseconds at import, paid by every ``soup`` start.)"""

    def __init__(self, bound: float) -> None:
        self.bound = bound

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        schema = handler(source)
        schema["ge"] = self.bound
        return schema


FIELDS: list[ConfigField] = [
    ConfigField(
        "training.grpo_variant",
        GrpoVariant,
        "grpo",
        "grpo task: the policy loss — " + ", ".join(VARIANT_NAMES) + " (see the rl plugin's README).",
    ),
    ConfigField(
        "training.num_generations",
        Annotated[int, Ge(2)],
        4,
        "grpo task: completions generated per prompt (a group); advantages are relative within a group.",
    ),
    ConfigField(
        "training.beta",
        Annotated[float, Ge(0)],
        0.1,
        "grpo: the KL coefficient against the reference (0 drops the KL term); dpo/ipo/bco/kto/cpo/simpo: "
        "the loss's β; orpo: λ, the odds-ratio weight. A controller may change it during a run.",
    ),
    ConfigField(
        "training.reward_fn",
        str | list[str],
        "accuracy",
        "grpo task: reward function(s) — accuracy (exact match against the row's answer), format "
        "(<think>…</think><answer>…</answer>), length (shorter is better), or path/to/file.py:function.",
    ),
    ConfigField(
        "training.grpo_iterations",
        Annotated[int, Ge(1)],
        1,
        "grpo task: optimisation passes over each generated batch (trl's num_iterations, μ).",
    ),
    ConfigField(
        "training.max_completion_length",
        Annotated[int, Ge(1)],
        256,
        "grpo task: the most tokens generated per completion.",
    ),
]

def _core_fields(task: type[RLTask]) -> frozenset[str]:
    from soup_core.default_plugins.transformers import HONOURED_FIELDS

    # Preference and GRPO examples are built by trl from the rows: there is no response-only switch and no
    # packing. training.lora.dropout is honoured as what trl does with it (dropout 0): the pre-flight check
    # refuses any other value (DROPOUT_OFF says why).
    fields = set(HONOURED_FIELDS) - {"data.train_on_responses_only", "data.packing"}
    if not task.honours_max_length:
        fields.discard("data.max_length")
    return frozenset(fields)


@hookimpl
def soup_register_tasks() -> list[type]:
    return list(TASKS)


@hookimpl
def soup_register_data_formats() -> list[DataFormat]:
    return list(FORMATS)


@hookimpl
def soup_register_config_fields() -> list[ConfigField]:
    return [*FIELDS, *hack.config_fields()]


@hookimpl
def soup_register_controllers() -> list[type]:
    return hack.controllers()


@hookimpl
def soup_register_support() -> list[Support]:
    rows = []
    for task in TASKS:
        own = task.own_fields
        if task.name in hack.RL_TASKS:  # the reward-hack controller's tunables apply to the live-reward tasks
            own = own | frozenset(hack.FIELD_PATHS)
        rows.append(Support(backend="transformers", task=task.name, fields=_core_fields(task) | own))
    return rows


@hookimpl
def soup_register_probes() -> list[Probe]:
    checks = [Probe("trl installed", _trl_present)]
    checks += [Probe(f"trl {t.name}", t.probe, deep=True, scope=f"task:{t.name}") for t in TASKS]
    # cheap, so that `soup plugins list` marks ppo as unavailable without --check
    checks.append(Probe("ppo driver", _no_ppo_driver, scope="task:ppo"))
    return checks


def _no_ppo_driver() -> ProbeResult:
    reason = ("soup-plugin-rl 0.1 has no PPO driver: trl's PPOTrainer needs a reward model and a value "
              "model, which no config field names yet")
    return ProbeResult(False, reason, "use task grpo (no value model needed)")


def _trl_present() -> ProbeResult:
    """Cheap: trl, peft and datasets are installed (nothing imported)."""
    fix = "pip install 'soup-core[train]'"
    for dist in ("trl", "peft", "datasets"):
        result = probes.distribution(dist, fix=fix)
        if not result.ok:
            return result
    return ProbeResult(True, detail=f"trl {probes.distribution_version('trl')}")


# ------------------------------------------------------------------------------------------ pre-flight

#: Why the LoRA dropout is 0 in every task here: each passes trl's ``disable_dropout`` (so that the policy
#: and its reference score a sequence alike), and trl's ``disable_dropout_in_model`` then sets ``p = 0`` on
#: every ``torch.nn.Dropout`` of the model, PEFT's LoRA dropout included (trl 1.16;
#: tests/test_trustworthy.py asks the installed trl).
DROPOUT_OFF = ("trl's disable_dropout, which every rl task sets so that the policy and its reference score a "
               "sequence alike, sets every dropout layer to 0, the LoRA dropout included")


def _dropout(task: type[RLTask], lora: Any) -> PreflightReport | str | None:
    """A refusal for a LoRA dropout the run cannot honour, or the plan's line saying it is 0."""
    if int(lora.r) == 0 or float(lora.dropout) == 0:
        return None
    if "dropout" in getattr(lora, "model_fields_set", ()):
        return PreflightReport(
            f"rl: {task.name}",
            refusal=f"training.lora.dropout: {lora.dropout} cannot be honoured by task {task.name}: "
            + DROPOUT_OFF,
            fix="set training.lora.dropout: 0 (what the run does), or remove it",
        )
    return f"LoRA dropout: 0, not the default {lora.dropout} ({DROPOUT_OFF})"


def preflight_lines(config: Any) -> PreflightReport | None:
    """The rl part of the plan, or a refusal (what, and how to fix it)."""
    task = _BY_NAME.get(config.task)
    if task is None or task is PPOTask:  # ppo's probe already says why it cannot run
        return None
    t = config.training
    title = f"rl: {task.name}"
    preference = issubclass(task, PreferenceTask)
    if preference:
        if t.beta <= 0:
            return PreflightReport(
                title,
                refusal=f"task {task.name} needs training.beta above 0, got {t.beta}",
                fix="set training.beta (0.1 is usual)",
            )
    dropout = _dropout(task, t.lora)
    if isinstance(dropout, PreflightReport):
        return dropout
    reference = task.uses_reference(config)
    if reference and t.lora.r == 0:
        return PreflightReport(
            title,
            refusal=f"task {task.name} compares against a reference model, which here is the base with the "
            "LoRA adapter disabled; with training.lora.r: 0 there is no adapter to disable",
            fix="set training.lora.r above 0"
            + (" (or training.beta: 0 for grpo)" if task is GRPOTask else ""),
        )
    lines = [dropout] if dropout else []
    if reference:
        lines.append("reference: the base model with the LoRA adapter disabled")
    if preference:
        lines.append(f"β = {t.beta}; rewind: per-{task.row_loss_unit} losses")
        return PreflightReport(title, lines)
    from soup_plugin_rl.capabilities import find_pair
    from soup_plugin_rl.errors import CapabilityError
    from soup_plugin_rl.rewards import RewardError, check_spec, reward_specs
    from soup_plugin_rl.variants import plan_variant

    try:
        trainer_cls, config_cls = find_pair(task.trl_needs.pair)
        plan = plan_variant(str(t.grpo_variant), trainer_cls, config_cls)
    except CapabilityError as exc:
        return PreflightReport(
            title, refusal=str(exc), fix="choose another training.grpo_variant, or upgrade trl"
        )
    try:
        specs = reward_specs(t.reward_fn)
        for spec in specs:
            check_spec(spec, Path.cwd())
    except RewardError as exc:
        return PreflightReport(title, refusal=str(exc), fix="fix training.reward_fn")
    lines += [
        f"variant {plan.variant.name}: {plan.variant.computes}",
        f"  runs as: {plan.how}",
        f"rewards: {', '.join(specs)}; {t.num_generations} completions per prompt, up to "
        f"{t.max_completion_length} tokens; β = {t.beta}; {t.grpo_iterations} pass(es) per generation",
        "rewind: off (GRPO reports no per-row losses)",
    ]
    import os

    from soup_plugin_rl.variants import identical_variant

    # the launcher sets WORLD_SIZE (as for the ranks) while it checks a --nproc run
    same = identical_variant(plan.variant.name, iterations=int(t.grpo_iterations),
                             grad_accum=int(t.gradient_accumulation_steps),
                             world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if same:  # printed once, in the plan: comparing such variants compares one run with itself
        lines.append(same)
    return PreflightReport(title, lines)


@hookimpl
def soup_preflight(config: Any) -> PreflightReport | None:
    own, extra = preflight_lines(config), hack.preflight(config)
    if extra is None:
        return own
    if own is None or (extra.refusal and not own.refusal):
        return extra
    if not own.refusal:
        own.lines += [f"{extra.title}: {line}" for line in extra.lines]
    return own
