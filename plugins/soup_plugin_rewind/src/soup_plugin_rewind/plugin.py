"""The ``rewind`` plugin: the flight recorder, its config switch and the ``soup rewind`` command.

Registration is cheap (docs/architecture.md): this module imports the core's contracts and nothing heavy; the
command's module imports typer only.
"""

from __future__ import annotations

from typing import Literal

from soup_core import Command, ConfigField, Recorder, Support, hookimpl

#: Hook-API versions this plugin supports (min, max).
SOUP_HOOK_API = (1, 1)


@hookimpl
def soup_register_commands() -> list[Command]:
    from soup_plugin_rewind.cli import HELP, rewind

    return [Command(name="rewind", target=rewind, help=HELP)]


@hookimpl
def soup_register_config_fields() -> list[ConfigField]:
    return [
        ConfigField(
            path="training.rewind_log",
            annotation=bool,
            default=True,
            description="Write rewind.jsonl (each micro-batch's rows, losses and tokens) for soup rewind; "
            "false writes nothing.",
            observer=True,
        ),
        ConfigField(
            path="training.spike_guard",
            annotation=Literal["off", "skip", "quarantine"],
            default="off",
            description="Before an update, a spike soup rewind lists that also stands out from the run's noise "
            "skips it (skip); quarantine also excludes the outlier rows behind it for the rest of the run "
            "(quarantine.jsonl).",
        ),
    ]


@hookimpl
def soup_register_support() -> list[Support]:
    # the guard needs a backend that vetoes updates and masks rows (transformers), and a task whose rows'
    # losses are a token cross-entropy; other pairs refuse it
    why = ("the task declares no token_cross_entropy: its rows' losses are not shares of one loss that a "
           "spike could be read from (unlearning and GRPO losses move by design)")
    return [Support("transformers", "*", frozenset({"training.spike_guard"}), capability="token_cross_entropy",
                    reasons={"training.spike_guard": why})]


@hookimpl
def soup_register_controllers() -> list[type]:
    from soup_plugin_rewind.guard import SpikeGuard

    return [SpikeGuard]


@hookimpl
def soup_register_recorders() -> list[type[Recorder]]:
    from soup_plugin_rewind.recorder import RewindRecorder

    return [RewindRecorder]
