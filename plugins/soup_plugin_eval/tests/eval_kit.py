"""Helpers the tests share (the conftest puts this folder on sys.path: the tests import in importlib mode)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def sums(n: int, start: int = 0) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}
            for i in range(start, start + n)]



@dataclass
class Runs:
    home: Path  # the SOUP_HOME the runs are tracked in
    data: Path  # the training rows (16 chat rows)
    lora: object  # TrainingResult: LoRA r=8, dropout 0, a checkpoint after every step
    full: object  # TrainingResult: training.lora.r 0



def invoke(command, args: list[str], input: str | None = None):
    """Run one of the plugin's commands in this process, as `soup NAME ARGS` would."""
    import typer
    from typer.testing import CliRunner

    app = typer.Typer()
    name = command.__name__.rstrip("_")
    app.command(name)(command)
    app.command("unused", hidden=True)(lambda: None)  # two commands: typer keeps the command's own name off argv
    return CliRunner().invoke(app, [name, *[os.fspath(a) for a in args]], input=input)
