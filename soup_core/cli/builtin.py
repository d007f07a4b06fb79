"""The core's own commands, registered through the same hook as any plugin's (built-in ``core.cli``)."""

from __future__ import annotations

from soup_core.cli.plugins_cmd import plugins_app
from soup_core.cli.train_cmd import TRAIN_HELP, train
from soup_core.contracts import Command
from soup_core.hookspecs import hookimpl

SOUP_HOOK_API = (1, 1)


@hookimpl
def soup_register_commands() -> list[Command]:
    return [
        Command(name="train", target=train, help=TRAIN_HELP),
        Command(name="plugins", target=plugins_app, help="Inspect installed plugins."),
    ]
