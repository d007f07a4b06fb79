"""``soup init``: write a starter ``soup.yaml`` (and a small sample data file) that validates as written."""

from __future__ import annotations

from pathlib import Path

import typer

TEMPLATES: dict[str, dict[str, str]] = {
    "chat": {
        "format": "chat",
        "data": "data/train.jsonl",
        "about": "chat rows: {\"messages\": [{\"role\": \"user\", ...}, {\"role\": \"assistant\", ...}]}",
    },
    "alpaca": {
        "format": "alpaca",
        "data": "data/train.jsonl",
        "about": "alpaca rows: {\"instruction\": ..., \"input\": ..., \"output\": ...}",
    },
    "plain": {
        "format": "text",
        "data": "data/train.jsonl",
        "about": "plain-text rows: {\"text\": ...}",
    },
}

CONFIG = """\
# Soup config — every key is documented in docs/config.md. Validate with: soup train --dry-run
# the model to fine-tune: a local model folder, a .gguf file or a hub id
base: {base}
task: sft
backend: transformers
output: ./output

data:
  # {about}
  train: {data}
  format: {format}
  val_split: 0.0
  max_length: 1024

training:
  epochs: 3
  learning_rate: 2.0e-4
  batch_size: 4
  gradient_accumulation_steps: 1
  scheduler: linear
  lora:
    r: 8                         # 0 = full fine-tuning
    alpha: 16
    target_modules: auto
  quantization: none             # 4bit / 8bit need bitsandbytes
"""

DEFAULT_BASE = "Qwen/Qwen2.5-0.5B-Instruct"


def sample_rows(template: str) -> list[dict]:
    """A few rows in the template's format, so `soup train --dry-run` has something to check."""
    facts = [
        ("What is the capital of France?", "The capital of France is Paris."),
        ("How many legs does a spider have?", "A spider has eight legs."),
        ("What colour is a clear daytime sky?", "A clear daytime sky is blue."),
        ("What is 7 times 6?", "7 times 6 is 42."),
        ("Which planet is closest to the Sun?", "Mercury is the planet closest to the Sun."),
        ("What do bees make?", "Bees make honey."),
        ("How many days are in a leap year?", "A leap year has 366 days."),
        ("What is the boiling point of water at sea level in Celsius?", "Water boils at 100 degrees Celsius."),
    ]
    if template == "chat":
        return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                for q, a in facts]
    if template == "alpaca":
        return [{"instruction": q, "input": "", "output": a} for q, a in facts]
    return [{"text": f"Q: {q}\nA: {a}"} for q, a in facts]


def init(
    template: str = typer.Option("chat", "--template", "-t", help="chat, alpaca or plain."),
    output: Path = typer.Option(Path("soup.yaml"), "--output", "-o", help="Where to write the config."),
    base: str = typer.Option(DEFAULT_BASE, "--base",
                             help="The model to fine-tune (local folder, .gguf file or hub id)."),
    no_data: bool = typer.Option(False, "--no-data", help="Do not write a sample data file."),
    force: bool = typer.Option(False, "--force", "-f", help="Overwrite an existing config."),
) -> None:
    """Write a starter soup.yaml that validates as written, and a sample data file where none exists.

    Exit codes: 0 written; 1 the config exists (use --force) or cannot be written; 2 unknown template."""
    from rich.markup import escape

    from soup_core.io import atomic_write
    from soup_core.ui import console, print_error

    if template not in TEMPLATES:
        print_error(f"unknown template {template!r}; choose one of: {', '.join(TEMPLATES)}")
        raise typer.Exit(2)
    if output.exists() and not force:
        print_error(f"{output} exists; pass --force to overwrite it.")
        raise typer.Exit(1)
    spec = TEMPLATES[template]
    text = CONFIG.format(base=base, data=spec["data"], format=spec["format"], about=spec["about"])
    try:
        atomic_write(output, text)
    except OSError as exc:
        print_error(f"cannot write {output}: {exc}")
        raise typer.Exit(1) from None
    console.print(f"Wrote {escape(str(output))} (template {template}).")
    data_path = output.resolve().parent / spec["data"]
    if no_data:
        return
    if data_path.exists():
        console.print(f"Kept the existing data file {escape(str(data_path))}.")
        return
    import json

    rows = sample_rows(template)
    atomic_write(data_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    console.print(f"Wrote a sample data set of {len(rows)} rows to {escape(str(data_path))} — replace it with "
                  "your own data.")
    console.print("Next: soup train --dry-run, then soup train.")
