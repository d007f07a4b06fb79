"""``soup plugins list``: every plugin, its status, what it provides, and why when it is not ok."""

from __future__ import annotations

import typer

plugins_app = typer.Typer(help="Inspect installed plugins.", no_args_is_help=True)

#: keys of ``soup plugins list --json`` (documented in docs/plugins.md; add, never rename)
JSON_KEYS = ("name", "builtin", "distribution", "version", "status", "reason", "fix", "hook_api",
             "provides", "details")


@plugins_app.command("list")
def list_plugins(
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON (stable keys)."),
    check: bool = typer.Option(False, "--check", help="Also run the deep probes (may import heavy libraries)."),
) -> None:
    """List every plugin: built-ins, installed, failed, unavailable and disabled. Always exits 0 when
    the listing itself works, even if some plugins failed (their reasons are shown)."""
    from soup_core.plugins import load_plugins

    plugins = load_plugins()
    if check:
        plugins.deep_check()
    infos = list(plugins.plugins.values())
    if as_json:
        import json

        payload = {
            "plugins": [info.to_json() for info in infos],
            "unavailable": {
                scope: {"plugin": plugin, "reason": result.reason, "fix": result.fix or None}
                for scope, (plugin, result) in plugins.unavailable_scopes.items()
            },
        }
        typer.echo(json.dumps(payload, indent=2))
        return

    from rich.table import Table
    from rich.text import Text

    from soup_core.ui import console

    table = Table(title="Soup plugins", show_lines=False)
    for column in ("plugin", "distribution", "status", "provides"):
        table.add_column(column)
    styles = {"ok": "green", "unavailable": "yellow", "failed": "red", "disabled": "dim"}
    for info in infos:
        name = Text(info.name + (" (built-in)" if info.builtin else ""))
        provides = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in info.provides.items())
        if info.details:
            provides = (provides + "; " if provides else "") + "; ".join(info.details)
        status = Text(info.status, style=styles.get(info.status, ""))
        table.add_row(name, Text(f"{info.distribution} {info.version}"), status, Text(provides))
    console.print(table)
    # reasons go below the table, one plain line each, so they are never cut by a narrow terminal
    for info in infos:
        if info.status != "ok" and info.reason:
            line = f"{info.name} ({info.status}): {info.reason}" + (f" — fix: {info.fix}" if info.fix else "")
            console.print(Text(line))
    for scope, (plugin, result) in plugins.unavailable_scopes.items():
        console.print(Text(f"{scope} (plugin {plugin}) is unavailable: {result.reason}"
                           + (f" — fix: {result.fix}" if result.fix else "")))
