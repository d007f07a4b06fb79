"""The default plugin ``core.cli``: the core's own commands, registered through the same hook as any plugin's."""

from __future__ import annotations

from soup_core.contracts import Command
from soup_core.default_plugins.commands.cache_cmd import cache_app
from soup_core.default_plugins.commands.doctor_cmd import DOCTOR_HELP, doctor
from soup_core.default_plugins.commands.export_cmd import EXPORT_HELP, export
from soup_core.default_plugins.commands.init_cmd import init
from soup_core.default_plugins.commands.merge_cmd import merge
from soup_core.default_plugins.commands.plugins_cmd import plugins_app
from soup_core.default_plugins.commands.quickstart_cmd import quickstart
from soup_core.default_plugins.commands.train_cmd import TRAIN_HELP, train
from soup_core.hookspecs import hookimpl

SOUP_HOOK_API = (1, 1)


@hookimpl
def soup_register_commands() -> list[Command]:
    return [
        Command(name="quickstart", target=quickstart, help="Teach a real small model (SmolLM2-135M-Instruct) "
                "a new name on the CPU in a few minutes, with zero input: the fastest way to see Soup work."),
        Command(name="init", target=init, help="Write a starter soup.yaml that validates as written."),
        Command(name="train", target=train, help=TRAIN_HELP),
        Command(name="merge", target=merge, help="Merge a trained LoRA adapter into its base model."),
        Command(name="export", target=export, help=EXPORT_HELP),
        Command(name="plugins", target=plugins_app, help="Inspect installed plugins."),
        Command(name="doctor", target=doctor, help=DOCTOR_HELP),
        Command(name="cache", target=cache_app, help=cache_app.info.help),  # one text: `soup cache --help` shows it
    ]
