"""The shared rich consoles. Import-light: rich only."""

from __future__ import annotations

import sys

from rich.console import Console

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str, *, code: int = 1) -> None:
    """Print one plain error message to stderr and exit with ``code`` (no traceback)."""
    err_console.print(f"[bold red]error:[/] {message}", markup=True)
    sys.exit(code)
