"""The ``eval`` plugin's hooks: ``soup generate``, ``soup chat`` and ``soup eval``.

Imported at every CLI start, ``soup --help`` included: the command modules import typer only at module level.
"""

from __future__ import annotations

from soup_core import Command, hookimpl

#: Hook-API versions this plugin supports (min, max).
SOUP_HOOK_API = (1, 1)


@hookimpl
def soup_register_commands() -> list[Command]:
    from soup_plugin_eval.chat import CHAT_HELP, chat
    from soup_plugin_eval.cli import GENERATE_HELP, generate
    from soup_plugin_eval.eval_cmd import EVAL_HELP, eval_

    return [Command(name="generate", target=generate, help=GENERATE_HELP),
            Command(name="chat", target=chat, help=CHAT_HELP),
            Command(name="eval", target=eval_, help=EVAL_HELP)]
