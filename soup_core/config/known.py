"""First-party plugins' config keys, backends and tasks, so that a config using one whose plugin is not
installed gets the command that installs it instead of a bare "unknown key".

Only names are kept here; nothing is imported from any plugin (the core never depends on one).
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

from soup_core.distributions import canonical, version_of

# config path pattern (fnmatch, case-sensitive) -> distribution
KNOWN_FIELDS: dict[str, str] = {
    "training.stream_layers": "soup-plugin-streaming",
    "training.stream_buffers": "soup-plugin-streaming",
    "training.stream_source": "soup-plugin-streaming",
    "training.stream_pin": "soup-plugin-streaming",
    "training.rewind_log": "soup-plugin-rewind",
    "training.spike_guard": "soup-plugin-rewind",
    "training.grpo_variant": "soup-plugin-rl",
    "training.num_generations": "soup-plugin-rl",
    "training.grpo_iterations": "soup-plugin-rl",
    "training.max_completion_length": "soup-plugin-rl",
    "training.beta": "soup-plugin-rl",
    "training.reward_fn": "soup-plugin-rl",
    "training.reward_hack_*": "soup-plugin-rl",
    "training.unlearn_*": "soup-plugin-unlearn",
    "data.forget": "soup-plugin-unlearn",
    "data.retain": "soup-plugin-unlearn",
    "training.teacher_model": "soup-plugin-distill",
    "training.distill_*": "soup-plugin-distill",
}

KNOWN_BACKENDS: dict[str, str] = {"mlx": "soup-plugin-mlx"}

KNOWN_TASKS: dict[str, str] = {
    **{name: "soup-plugin-rl" for name in ("grpo", "dpo", "ipo", "kto", "orpo", "simpo", "cpo", "bco", "ppo")},
    "unlearn": "soup-plugin-unlearn",
    "distill": "soup-plugin-distill",
}


def distribution_for_path(path: str) -> str | None:
    """The first-party distribution that owns config key ``path``, or None."""
    for pattern, dist in KNOWN_FIELDS.items():
        if fnmatchcase(path, pattern):
            return dist
    return None


def absent_reason(distribution: str, not_loaded: Sequence[tuple[str, str, str]] = ()) -> tuple[str, str | None]:
    """Why a first-party plugin's key, task or backend is not available: (phrase, install command or None).

    ``not_loaded`` holds the installed plugins that are disabled or failed, as (plugin, distribution, why):
    one from ``distribution`` is named with its reason, and needs no install command.
    """
    for plugin, dist, why in not_loaded:
        if canonical(dist) == canonical(distribution):
            return f"plugin '{plugin}' ({dist}), which is installed but not loaded ({why})", None
    name = distribution.removeprefix("soup-plugin-")  # a first-party plugin's entry-point name
    if version_of(distribution) is not None:
        return (f"plugin '{name}' ({distribution}), which is installed but not loaded (see `soup plugins list`)",
                None)
    return f"plugin '{name}' ({distribution}), which is not installed", f"pip install {distribution}"


def not_loaded_note(not_loaded: Sequence[tuple[str, str, str]]) -> str:
    """A note naming the installed plugins that are disabled or failed, any of which may provide a name the
    config uses ("" when every installed plugin is loaded). They are not imported to find out."""
    if not not_loaded:
        return ""
    shown = "; ".join(f"plugin '{plugin}' ({dist}): {why}" for plugin, dist, why in not_loaded)
    return f" — installed but not loaded, and may provide it: {shown}"
