"""``soup export ADAPTER --to peft -o FOLDER``: convert what a ``backend: mlx`` run wrote into a PEFT adapter.

The core's ``soup export`` dispatches ``--to peft`` here (an ``ExportTarget``). Import-light (typer only):
``soup --help`` imports this module; mlx is imported when the export runs.
"""

from __future__ import annotations

from pathlib import Path

import typer

EXPORT_HELP = ("peft: an mlx LoRA adapter (the folder a backend: mlx run wrote, or a checkpoint-N folder) "
               "as a PEFT adapter that transformers, peft and soup merge load; -o FOLDER (new or empty), "
               "--base to record another base than the adapter's")


def export_peft_target(adapter: str, output: Path | None = None, base: str | None = None) -> None:
    """Convert an mlx-lm LoRA adapter (adapters.safetensors + adapter_config.json) into a PEFT adapter
    (adapter_model.safetensors + adapter_config.json), which transformers/peft load and `soup merge`
    folds into the base model.

    Exit codes: 0 converted; 1 not an mlx LoRA adapter, no -o, or output not empty."""
    from rich.console import Console
    from rich.markup import escape

    from soup_core import console

    def fail(message: str) -> None:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}")
        raise typer.Exit(1)

    if output is None:
        fail("--to peft needs -o FOLDER: where to write the PEFT adapter (a new or empty folder)")
    from soup_plugin_mlx.adapters import AdapterError, export_peft

    try:
        out = export_peft(Path(adapter), output, base=base)
    except (AdapterError, OSError) as exc:
        fail(str(exc))
    console.print(f"Wrote a PEFT adapter: {escape(str(adapter))} → {escape(str(out))}")
