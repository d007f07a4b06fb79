"""The ``gguf`` plugin's hooks: the ``gguf`` and ``ollama`` formats of ``soup export``.

Imported at every CLI start, ``soup --help`` included: nothing here imports gguf, torch or transformers.
"""

from __future__ import annotations

from soup_core import hookimpl
from soup_core.contracts import ExportTarget

#: Hook-API versions this plugin supports (min, max).
SOUP_HOOK_API = (1, 1)

GGUF_HELP = ("gguf: one GGUF file (llama.cpp, LM Studio) of TARGET (an output folder, a checkpoint, a run id, "
             "latest, a merged folder or a .gguf file); --type f32|f16|bf16|q8_0|same, -o FILE.gguf")
OLLAMA_HELP = "ollama: -o FOLDER with the GGUF file and a Modelfile (the run's chat template, its stop tokens)"


def _gguf(target: str, output: object = None, type: str | None = None) -> None:  # noqa: A002 - the --type option
    from soup_plugin_gguf.export import run_gguf

    run_gguf(target, output, type)


def _ollama(target: str, output: object = None, type: str | None = None) -> None:  # noqa: A002
    from soup_plugin_gguf.export import run_ollama

    run_ollama(target, output, type)


@hookimpl
def soup_register_export_targets() -> list[ExportTarget]:
    return [ExportTarget(name="gguf", run=_gguf, help=GGUF_HELP, options=("output", "type")),
            ExportTarget(name="ollama", run=_ollama, help=OLLAMA_HELP, options=("output", "type"))]
