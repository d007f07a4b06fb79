"""First-party plugins' config keys, backends and tasks, so that a config using one whose plugin is not
installed gets the command that installs it instead of a bare "unknown key".

Only names are kept here; nothing is imported from any plugin (the core never depends on one).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

# distribution -> the short plugin name (its entry-point name)
PLUGIN_NAMES: dict[str, str] = {
    "soup-plugin-streaming": "streaming",
    "soup-plugin-rewind": "rewind",
    "soup-plugin-mlx": "mlx",
    "soup-plugin-rl": "rl",
    "soup-plugin-unlearn": "unlearn",
    "soup-plugin-distill": "distill",
}

# config path pattern (fnmatch, case-sensitive) -> distribution
KNOWN_FIELDS: dict[str, str] = {
    "training.stream_layers": "soup-plugin-streaming",
    "training.stream_buffers": "soup-plugin-streaming",
    "training.stream_source": "soup-plugin-streaming",
    "training.stream_pin": "soup-plugin-streaming",
    "training.rewind_log": "soup-plugin-rewind",
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


def install_command(distribution: str) -> str:
    return f"pip install {distribution}"


def is_installed(distribution: str) -> bool:
    """Whether ``distribution`` is installed (metadata only: nothing is imported)."""
    from importlib import metadata

    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def absent_reason(distribution: str) -> tuple[str, str | None]:
    """Why a first-party plugin's key is not available: (phrase, install command or None).

    A plugin that is installed but not loaded (disabled, or failed to load) needs no install command.
    """
    name = PLUGIN_NAMES.get(distribution, distribution)
    if is_installed(distribution):
        return (
            f"plugin '{name}' ({distribution}), which is installed but not loaded (disabled, or it "
            f"failed to load: see `soup plugins list`)",
            None,
        )
    return f"plugin '{name}' ({distribution}), which is not installed", install_command(distribution)
