"""The shared rich consoles. Import-light: rich only."""

from __future__ import annotations

from rich.console import Console

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def print_error(message: str) -> None:
    """One plain error message on stderr (``error: ...``); ``message`` is shown as written, never as markup."""
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(message)}")
