"""The reward-hack controller's config: every ``training.reward_hack_*`` field, which mode uses it, and the
pre-flight check that refuses a tunable set for a mode that does not read it.

Light at import: imported when the plugin registers its fields, at every CLI start, so the constrained
types are named (``"module:attr"``, in :mod:`soup_plugin_rl.hack.field_types`) and imported when a config
is validated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, NamedTuple

from soup_core import ConfigField, PreflightReport

PREFIX = "training.reward_hack_"
MODES = ("off", "log_only", "kl_control", "pid_lagrangian")
#: The tasks with a live, gameable reward: the only ones the controller acts on.
RL_TASKS: tuple[str, ...] = ("grpo", "ppo")
DETECTORS = ("info_rm", "rm_ensemble")
SIGNALS = ("info_rm", "rm_ensemble", "length_trend", "repetition")

_WATCH = frozenset({"log_only", "kl_control", "pid_lagrangian"})  # every mode that judges steps
_STEER = frozenset({"kl_control", "pid_lagrangian"})  # every mode that moves β
_KL = frozenset({"kl_control"})
_PID = frozenset({"pid_lagrangian"})

Mode = Literal["off", "log_only", "kl_control", "pid_lagrangian"]
_TYPES = "soup_plugin_rl.hack.field_types:"
Fraction = _TYPES + "Fraction"
OpenFraction = _TYPES + "OpenFraction"
Positive = _TYPES + "Positive"
NonNegative = _TYPES + "NonNegative"
Count = _TYPES + "Count"


class Tunable(NamedTuple):
    """One ``training.reward_hack_<name>`` field and the modes that read it."""

    name: str
    annotation: Any
    default: Any
    modes: frozenset[str]
    description: str

    @property
    def path(self) -> str:
        return PREFIX + self.name


TUNABLES: tuple[Tunable, ...] = (
    Tunable(
        "mitigation",
        Mode,
        "off",
        frozenset(MODES),
        "grpo/ppo: the reward-hack controller — off; log_only (judge every step, change nothing); "
        "kl_control (bang-bang on β with hysteresis); pid_lagrangian (PID law on β, plus rollback to "
        "the last good checkpoint and a stop with a postmortem).",
    ),
    Tunable(
        "detector",
        Literal["info_rm", "rm_ensemble"],
        "info_rm",
        _WATCH,
        "the hacking detector: info_rm (separation between the top and bottom halves of the batch's "
        "rewards, Wang et al. 2024; a batch whose rewards do not spread is unjudged, verdict flat) or "
        "rm_ensemble (disagreement across the reward functions, Coste et al. 2024; needs two or more).",
    ),
    Tunable(
        "signals",
        list[Literal["info_rm", "rm_ensemble", "length_trend", "repetition"]] | None,
        None,
        _WATCH,
        "the signals that vote (each in [0, 1]); must include the detector; null = the detector alone. "
        "length_trend: growth of the mean completion length; repetition: repeated word trigrams.",
    ),
    Tunable(
        "vote",
        Literal["mean", "max"],
        "mean",
        _WATCH,
        "how the signals combine: their mean, or the most alarmed one (max).",
    ),
    Tunable(
        "smoothing",
        Literal["none", "ema", "median"],
        "none",
        _WATCH,
        "smoothing of the vote over recent steps: none, ema (α = 2/(window+1)) or median.",
    ),
    Tunable(
        "smoothing_window",
        _TYPES + "Window",
        8,
        _WATCH,
        "steps the smoothing looks back over (only with smoothing ema or median).",
    ),
    Tunable(
        "baseline_steps",
        Count,
        1,
        _WATCH,
        "the first steps with a signal set each signal's healthy baseline (their mean; info_rm's: their "
        "median, and only a fall beyond their scatter counts); no verdict then.",
    ),
    Tunable(
        "warn_at", _TYPES + "OpenUnit", 0.10, _WATCH, "the vote from which a step is judged warn."
    ),
    Tunable(
        "hack_at",
        Fraction,
        0.30,
        _WATCH,
        "the vote from which a step is judged hack (must be above warn_at).",
    ),
    Tunable(
        "beta_floor",
        Positive,
        0.02,
        _STEER,
        "the lowest β the controller sets (above 0: β never reaches zero); pid_lagrangian rests there.",
    ),
    Tunable("beta_ceil", Positive, 1.0, _STEER, "the highest β the controller sets."),
    Tunable("trip", Fraction, 0.30, _KL, "kl_control: the vote at or above which β is raised."),
    Tunable(
        "release",
        OpenFraction,
        0.10,
        _KL,
        "kl_control: the vote at or below which β is relaxed (below trip).",
    ),
    Tunable("dwell", Count, 2, _KL, "kl_control: consecutive steps at or above trip before the first raise."),
    Tunable(
        "release_patience",
        Count,
        3,
        _KL,
        "kl_control: consecutive steps at or below release before each relaxation.",
    ),
    Tunable(
        "gain",
        _TYPES + "Gain",
        1.5,
        _KL,
        "kl_control: β is multiplied by this to raise it and divided by it to relax it.",
    ),
    Tunable("kp", NonNegative, 0.5, _PID, "pid_lagrangian: proportional gain."),
    Tunable("ki", NonNegative, 0.1, _PID, "pid_lagrangian: integral gain."),
    Tunable("kd", NonNegative, 0.05, _PID, "pid_lagrangian: derivative gain."),
    Tunable(
        "target", OpenFraction, 0.15, _PID, "pid_lagrangian: the vote the law holds the run at or below."
    ),
    Tunable(
        "integral_clamp",
        Positive,
        1.0,
        _PID,
        "pid_lagrangian: the integral of the error is kept within ± this.",
    ),
    Tunable(
        "rollback",
        bool,
        True,
        _PID,
        "pid_lagrangian: when hacking persists, restore model and optimizer from the last good "
        "checkpoint (needs training.save_steps).",
    ),
    Tunable(
        "rollback_patience",
        Count,
        3,
        _PID,
        "pid_lagrangian: consecutive hack steps before a rollback (or, once recoveries are spent, a stop).",
    ),
    Tunable(
        "max_recoveries",
        Count,
        2,
        _PID,
        "pid_lagrangian: recovery attempts allowed; the next time hacking persists the run stops with a "
        "postmortem.",
    ),
)

#: Every field path this module registers (for the support-table rows of the tasks it acts on).
FIELD_PATHS: frozenset[str] = frozenset(t.path for t in TUNABLES)


def config_fields() -> list[ConfigField]:
    """Every ``training.reward_hack_*`` field, typed (pydantic validates each value on its own)."""
    return [ConfigField(t.path, t.annotation, t.default, t.description) for t in TUNABLES]


@dataclass(frozen=True)
class HackSettings:
    """The controller's settings, read from a validated config (defaults where a field is absent)."""

    mitigation: str = "off"
    detector: str = "info_rm"
    signals: tuple[str, ...] = ()
    vote: str = "mean"
    smoothing: str = "none"
    smoothing_window: int = 8
    baseline_steps: int = 1
    warn_at: float = 0.10
    hack_at: float = 0.30
    beta_floor: float = 0.02
    beta_ceil: float = 1.0
    trip: float = 0.30
    release: float = 0.10
    dwell: int = 2
    release_patience: int = 3
    gain: float = 1.5
    kp: float = 0.5
    ki: float = 0.1
    kd: float = 0.05
    target: float = 0.15
    integral_clamp: float = 1.0
    rollback: bool = True
    rollback_patience: int = 3
    max_recoveries: int = 2

    @property
    def active_signals(self) -> tuple[str, ...]:
        """The voting signals: the configured list, or the detector alone."""
        return self.signals or (self.detector,)


def settings_from(config: Any) -> HackSettings:
    """The settings in ``config.training`` (a field the schema lacks keeps its default)."""
    training = getattr(config, "training", None)
    values: dict[str, Any] = {}
    for f in fields(HackSettings):
        value = getattr(training, "reward_hack_" + f.name, None) if training is not None else None
        if value is None:
            continue
        values[f.name] = tuple(value) if f.name == "signals" else value
    return HackSettings(**values)


def _same(value: Any, default: Any) -> bool:
    return isinstance(value, bool) == isinstance(default, bool) and bool(value == default)


def _set_tunables(config: Any) -> list[Tunable]:
    """The tunables (other than the mode) whose value differs from the default."""
    training = getattr(config, "training", None)
    out = []
    for t in TUNABLES[1:]:
        value = getattr(training, "reward_hack_" + t.name, t.default)
        if not _same(value, t.default):
            out.append(t)
    return out


class Problem(NamedTuple):
    message: str
    fix: str


def check(config: Any, tasks: Sequence[str] = RL_TASKS) -> list[Problem]:
    """Everything wrong with the config's reward-hack settings (empty when all is well)."""
    s = settings_from(config)
    mode = s.mitigation
    problems: list[Problem] = []
    set_now = _set_tunables(config)
    if mode == "off":
        for t in set_now:
            problems.append(
                Problem(
                    f"{t.path} is set but training.reward_hack_mitigation is off, so nothing reads it",
                    f"set training.reward_hack_mitigation ({', '.join(sorted(t.modes - {'off'}))}) "
                    f"or remove {t.path}",
                )
            )
        return problems
    task = getattr(config, "task", None)
    if task not in tasks:
        problems.append(
            Problem(
                f"training.reward_hack_mitigation: {mode} acts on tasks with a live reward "
                f"({', '.join(tasks)}); this run's task is {task}",
                "set training.reward_hack_mitigation: off (or remove it)",
            )
        )
    for t in set_now:
        if mode not in t.modes:
            users = ", ".join(m for m in MODES if m in t.modes)
            problems.append(
                Problem(
                    f"{t.path} is set but mode {mode} does not use it (used by: {users})",
                    f"remove {t.path}, or choose a mode that uses it",
                )
            )
    problems += _cross_field(config, s, {t.name for t in set_now})
    return problems


def _cross_field(config: Any, s: HackSettings, set_names: set[str]) -> list[Problem]:
    mode = s.mitigation
    out: list[Problem] = []
    if s.signals and s.detector not in s.signals:
        out.append(
            Problem(
                f"training.reward_hack_signals {list(s.signals)} leaves out the detector {s.detector}",
                f"add {s.detector} to training.reward_hack_signals",
            )
        )
    if len(set(s.signals)) != len(s.signals):
        out.append(Problem("training.reward_hack_signals names a signal twice", "list each signal once"))
    if "smoothing_window" in set_names and s.smoothing == "none":
        out.append(
            Problem(
                "training.reward_hack_smoothing_window is set but training.reward_hack_smoothing is none",
                "set training.reward_hack_smoothing: ema or median, or remove the window",
            )
        )
    if s.warn_at >= s.hack_at:
        out.append(
            Problem(
                f"training.reward_hack_warn_at ({s.warn_at}) must be below training.reward_hack_hack_at "
                f"({s.hack_at})",
                "lower warn_at or raise hack_at",
            )
        )
    uses_ensemble = s.detector == "rm_ensemble" or "rm_ensemble" in s.signals
    reward_fn = getattr(getattr(config, "training", None), "reward_fn", None)
    if uses_ensemble and reward_fn is not None:
        n = 1 if isinstance(reward_fn, str) else len(reward_fn)
        if n < 2:
            out.append(
                Problem(
                    f"rm_ensemble measures disagreement across reward functions, but training.reward_fn "
                    f"names {n}",
                    "list two or more functions in training.reward_fn, or use the info_rm detector",
                )
            )
    if mode in _STEER:
        if s.beta_floor >= s.beta_ceil:
            out.append(
                Problem(
                    f"training.reward_hack_beta_floor ({s.beta_floor}) must be below beta_ceil "
                    f"({s.beta_ceil})",
                    "lower the floor or raise the ceiling",
                )
            )
        beta = getattr(getattr(config, "training", None), "beta", None)
        if beta is not None and not beta > 0:
            out.append(
                Problem(
                    f"mode {mode} steers the KL coefficient, but training.beta is {beta}: a run started at "
                    "β = 0 computes no reference log-probabilities, so β could never be raised",
                    "set training.beta above 0 (0.04 is common)",
                )
            )
        elif beta is not None and mode == "kl_control" and not s.beta_floor <= beta <= s.beta_ceil:
            out.append(
                Problem(
                    f"training.beta ({beta}) is outside the controller's range "
                    f"[{s.beta_floor}, {s.beta_ceil}]",
                    "set training.beta between training.reward_hack_beta_floor and beta_ceil",
                )
            )
    if mode == "kl_control" and not s.release < s.trip:
        out.append(
            Problem(
                f"training.reward_hack_release ({s.release}) must be below training.reward_hack_trip "
                f"({s.trip}): the gap between them is the hysteresis",
                "lower release or raise trip",
            )
        )
    if mode == "pid_lagrangian" and s.rollback:
        save_steps = getattr(getattr(config, "training", None), "save_steps", None)
        if not save_steps:
            out.append(
                Problem(
                    "the rollback ladder (training.reward_hack_rollback, on by default in pid_lagrangian) "
                    "restores the last good checkpoint, but training.save_steps is not set, so none is saved",
                    "set training.save_steps (e.g. 10), or training.reward_hack_rollback: false",
                )
            )
    if not s.rollback:
        for name in ("rollback_patience", "max_recoveries"):
            if name in set_names:
                out.append(
                    Problem(
                        f"training.reward_hack_{name} is set but training.reward_hack_rollback is false",
                        f"remove training.reward_hack_{name}, or turn the rollback on",
                    )
                )
    return out


def describe(s: HackSettings) -> list[str]:
    """The plan's lines for the controller."""
    lines = [
        f"mode {s.mitigation}; detector {s.detector}; signals {', '.join(s.active_signals)} "
        f"({s.vote}); verdict warn ≥ {s.warn_at}, hack ≥ {s.hack_at}; log: mitigation_log.jsonl"
    ]
    if s.mitigation == "kl_control":
        lines.append(
            f"β × {s.gain} after {s.dwell} step(s) at vote ≥ {s.trip}, ÷ {s.gain} after "
            f"{s.release_patience} at ≤ {s.release}; β within [{s.beta_floor}, {s.beta_ceil}]"
        )
    elif s.mitigation == "pid_lagrangian":
        lines.append(
            f"β = clamp({s.beta_floor} + {s.kp}·e + {s.ki}·∫e + {s.kd}·Δe) ≤ {s.beta_ceil}, "
            f"e = vote − {s.target}, ∫e within ±{s.integral_clamp}; β rests at the floor while the "
            "vote stays below the target (training.beta is only its value until the first verdict)"
        )
        if s.rollback:
            lines.append(
                f"rollback to the last good checkpoint after {s.rollback_patience} hack step(s); "
                f"stop with a postmortem once {s.max_recoveries} recovery attempt(s) are spent"
            )
    return lines


def preflight(config: Any, tasks: Sequence[str] = RL_TASKS) -> PreflightReport | None:
    """None when the controller is off and untouched; else the plan's lines, or a refusal naming every
    problem and its fix."""
    problems = check(config, tasks)
    s = settings_from(config)
    if not problems and s.mitigation == "off":
        return None
    title = "reward-hack controller"
    if problems:
        refusal = "; ".join(p.message for p in problems)
        fix = "; ".join(dict.fromkeys(p.fix for p in problems))
        return PreflightReport(title, refusal=refusal, fix=fix)
    return PreflightReport(title, lines=describe(s))
