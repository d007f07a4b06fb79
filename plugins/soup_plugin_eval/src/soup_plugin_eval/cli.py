"""``soup generate``: completions from what a run trained, for typed prompts or the prompt side of a data file.

Import-light: typer at module level; torch, transformers and peft when the command runs.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

TARGET_HELP = ("An output folder (LoRA adapter, full model, or a folder soup merge wrote), a checkpoint-N folder, "
               "a run id (or unique prefix) or `latest`.")
EXIT_CODES = "Exit codes: 0 done; 1 the target or the data cannot be used (the message says why); 2 usage errors."

GENERATE_HELP = f"""Generate completions from a trained model, with the run's base, chat template and encoding.

\b
  soup generate latest -p "What is 2 plus 2?"
  soup generate out/checkpoint-40 --input held_out.jsonl --output preds.jsonl
  soup generate RUN -p "Tell a story" --temperature 0.8 --top-p 0.95 --seed 1

Greedy unless --temperature is above 0; each row stops where the model's generation config stops it, or \
after --max-new-tokens. Prompts are batched (--batch-size) with left padding. To stdout goes each \
completion's text (special tokens skipped); --output writes JSON Lines: index (the prompt's position, or the \
row's index in --input), prompt, completion, tokens (the generated ids) and the row's own answer when it has \
one (reference).

{EXIT_CODES}
"""


class Fail(Exception):
    """Stop a command with one message and an exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def run_command(body: Callable[[], None]) -> None:
    """Run ``body``; a :class:`Fail` or a known error becomes one line on stderr and its exit code."""
    from soup_core import DataError
    from soup_plugin_eval.prompts import PromptError
    from soup_plugin_eval.target import TargetError

    try:
        body()
    except Fail as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.code) from None
    except (TargetError, PromptError, DataError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None


def status(message: str) -> None:
    """A line for the user that is not a result: stderr, so stdout stays the results."""
    typer.echo(message, err=True)


class Progress:
    """``generating 64/256 rows (12.3 rows/s)`` on stderr: redrawn in place on a terminal, a line per ~10%."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.started = what, total, time.monotonic()
        self.tty = sys.stderr.isatty()
        self.shown = 0

    def __call__(self, done: int) -> None:
        rate = done / max(time.monotonic() - self.started, 1e-9)
        line = f"{self.what} {done}/{self.total} rows ({rate:.1f} rows/s)"
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done >= self.total else ""))
            sys.stderr.flush()
        elif done >= self.total or done - self.shown >= max(1, self.total // 10):
            self.shown = done
            status(line)


def load_target(spec: str) -> tuple[Any, Any]:
    """Resolve and load ``spec``: (target, loaded)."""
    from soup_core import load_plugins
    from soup_plugin_eval.model import load
    from soup_plugin_eval.target import resolve

    target = resolve(spec, plugins=load_plugins())
    started = time.monotonic()
    status(f"loading {target.label} ({target.kind}" + (f" over {target.base}" if target.kind != "model" else "")
           + ") ...")
    loaded = load(target)
    if time.monotonic() - started > 2:
        status(f"loaded in {time.monotonic() - started:.1f} s")
    return target, loaded


Completed = list[tuple[Any, list[int], str]]  # each prompt, its generated ids, their text


def complete(loaded: Any, spec: Any, *, rows: list[dict[str, Any]], typed: list[str], system: str | None,
             sampling: Any, batch_size: int, progress: Callable[[int], None] | None = None) -> Completed:
    """Each prompt (the prompt side of ``rows``, else the ``typed`` prompts in the run's format), its generated
    ids and their text, in order: what ``soup generate`` does once the model is loaded."""
    from soup_plugin_eval.model import generate as run_generate
    from soup_plugin_eval.prompts import row_prompt, typed_prompt

    if rows:
        prompts = [row_prompt(i, row, loaded.tokenizer) for i, row in enumerate(rows)]
    else:
        prompts = [typed_prompt(i, text, loaded.tokenizer, data_format=spec.data_format, system=system)
                   for i, text in enumerate(typed)]
    ids = run_generate(loaded, [p.ids for p in prompts], sampling, batch_size=batch_size, progress=progress)
    return [(p, row, loaded.tokenizer.decode(row, skip_special_tokens=True)) for p, row in zip(prompts, ids,
                                                                                              strict=True)]


def predictions(done: Completed) -> str:
    """``--output``'s JSON Lines: one line per prompt, with its index."""
    lines = []
    for p, row, text in done:
        record = {"index": p.index, "prompt": p.text, "completion": text, "tokens": row}
        if p.reference is not None:
            record["reference"] = p.reference
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    return "".join(lines)


def generate(
    target: str = typer.Argument(..., metavar="TARGET", help=TARGET_HELP),
    prompt: list[str] = typer.Option([], "--prompt", "-p", help="A prompt (repeatable)."),
    input_file: Path | None = typer.Option(None, "--input", "-i", metavar="FILE",
                                           help="A data file in any format Soup trains on: the prompt side of "
                                           "each row."),
    output: Path | None = typer.Option(None, "--output", "-o", metavar="PATH",
                                       help="Write JSON Lines here instead of the text to stdout."),
    system: str | None = typer.Option(None, "--system", help="A system message before each typed prompt "
                                      "(chat runs)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1, help="Most tokens generated per row."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0: greedy; above 0: sampling."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Nucleus sampling (with --temperature)."),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling."),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Prompts generated together."),
) -> None:
    """Generate completions from a trained model (see GENERATE_HELP)."""

    def body() -> None:
        if bool(prompt) == (input_file is not None):
            raise Fail("give --prompt (one or more) or --input FILE, not both and not neither", 2)
        if top_p < 1.0 and temperature <= 0:
            raise Fail("--top-p samples, so it needs --temperature above 0 (greedy ignores it)", 2)
        from soup_core import atomic_write, load_plugins
        from soup_plugin_eval.model import Sampling
        from soup_plugin_eval.prompts import read_rows

        rows: list[dict[str, Any]] = []
        if input_file is not None:
            if not input_file.is_file():
                raise Fail(f"--input {input_file}: no such file")
            rows, _ = read_rows(input_file, load_plugins())
            if system:
                raise Fail("--system applies to typed prompts; the rows of --input carry their own messages", 2)
        spec, loaded = load_target(target)
        progress = Progress("generating", len(rows)) if input_file is not None else None
        done = complete(loaded, spec, rows=rows, typed=prompt, system=system,
                        sampling=Sampling(max_new_tokens, temperature, top_p, seed), batch_size=batch_size,
                        progress=progress)
        if output is None:
            for _, _, text in done:
                typer.echo(text)
            return
        try:
            atomic_write(output, predictions(done))
        except OSError as exc:
            raise Fail(f"--output {output}: {exc}") from None
        status(f"wrote {len(done)} completions to {output}")

    run_command(body)
