"""The reward-hack controller of the rl plugin: detect reward hacking on grpo/ppo runs, steer the KL
coefficient live, roll back to the last good checkpoint, stop with a postmortem.

What the plugin wires (its hookimpls call these):

- :func:`config_fields` — every ``training.reward_hack_*`` field (``soup_register_config_fields``);
  :data:`FIELD_PATHS` joins the support rows of the tasks the controller acts on.
- :func:`controllers` — the controller classes (``soup_register_controllers``).
- :func:`preflight` — the plan's lines, or a refusal (``soup_preflight``).
- :func:`publish_rewards` — called by a trainer each step to put the batch's reward statistics in its
  optimizer-step metrics, where the controller reads them.

Import-light: nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from soup_core import ConfigField, Controller, PreflightReport
from soup_plugin_rl.hack.config import FIELD_PATHS, RL_TASKS, TUNABLES
from soup_plugin_rl.hack.config import config_fields as _config_fields
from soup_plugin_rl.hack.config import preflight as _preflight
from soup_plugin_rl.hack.signals import publish_rewards

__all__ = [
    "FIELD_PATHS",
    "RL_TASKS",
    "TUNABLES",
    "config_fields",
    "controllers",
    "preflight",
    "publish_rewards",
]


def config_fields() -> list[ConfigField]:
    """Every ``training.reward_hack_*`` config field (the mode, ``training.reward_hack_mitigation``,
    defaults to ``off``)."""
    return _config_fields()


def controllers() -> list[type[Controller]]:
    """The controller classes to register (one instance per grpo/ppo run)."""
    from soup_plugin_rl.hack.controller import RewardHackController

    return [RewardHackController]


def preflight(config: Any, tasks: Sequence[str] = RL_TASKS) -> PreflightReport | None:
    """None when the controller is off and no tunable is set; else the plan's lines, or a refusal: a
    tunable set for a mode that does not use it, a mode set for a task other than ``tasks``, or
    inconsistent values (each with its fix)."""
    return _preflight(config, tasks)
