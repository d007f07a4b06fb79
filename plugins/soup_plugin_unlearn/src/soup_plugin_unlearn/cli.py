"""``soup unlearn``: ``eval`` (a run's forget/retain loss, starting model vs unlearned) and ``demo``.

Import-light: typer at module level (``soup --help`` imports this module); torch is imported by the body of
``eval`` and by the tiny model ``demo`` builds.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

HELP = "Machine unlearning: measure what a run forgot and kept; write the demo."

app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=False)


@app.command("eval")
def eval_command(
    run: str = typer.Option("latest", "--run", "-r", help="Run id, unique prefix, or 'latest'."),
    recall: bool = typer.Option(
        False, "--recall", help="Also measure greedy exact-match recall of each set."
    ),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Rows per forward pass."),
    json_path: Path | None = typer.Option(
        None, "--json", metavar="PATH", help="Also write the numbers as JSON."
    ),
) -> None:
    """Print an unlearn run's forget-set and retain-set loss: starting model vs unlearned.

    The base is loaded as the run loaded it (its dtype and quantization). Exit codes: 0 printed; 1 the run
    cannot be evaluated (not found, not an unlearn run, no trained model, data or base model gone, or the
    base cannot be loaded the way the run did)."""
    from rich.console import Console
    from rich.markup import escape

    from soup_core import atomic_write, console
    from soup_plugin_unlearn.report import EvalError, evaluate_run, render

    try:
        result = evaluate_run(run, recall=recall, batch_size=batch_size)
    except EvalError as exc:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(1) from None
    render(result, console)
    if json_path is not None:
        atomic_write(json_path, json.dumps(result, indent=2) + "\n")


@app.command("demo")
def demo_command(
    folder: Path = typer.Argument(Path("unlearn-demo"), help="Where to write the demo."),
) -> None:
    """Write the demo: facts to forget and to keep, a config that teaches them to a tiny model, and one
    config per unlearning method."""
    from soup_core import console
    from soup_plugin_unlearn.demo import write_demo

    written = write_demo(folder)
    console.print(f"Wrote {', '.join(sorted(written))} to {folder}. Then:")
    console.print(f"  soup train -c {folder}/learn.yaml            # teach the tiny model the facts")
    console.print(f"  soup train -c {folder}/unlearn-npo.yaml      # forget forget.jsonl, keep retain.jsonl")
    console.print("  soup unlearn eval --run latest --recall")
