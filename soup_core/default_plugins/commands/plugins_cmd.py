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

    # three columns, the distribution under the plugin's name: at 80 columns "provides" keeps half the width,
    # and a long name folds onto the next line instead of being cut to "training.reward_hac…"
    table = Table(title="Soup plugins", show_lines=False)
    table.add_column("plugin", overflow="fold", max_width=26)
    table.add_column("status")
    table.add_column("provides", overflow="fold", ratio=1)
    styles = {"ok": "green", "unavailable": "yellow", "failed": "red", "disabled": "dim"}
    for info in infos:
        name = Text(info.name + (" (built-in)" if info.builtin else ""))
        name.append(f"\n{info.distribution} {info.version}", style="dim")
        provides = "; ".join(f"{kind}: {_names(kind, names, plugins.unavailable_scopes)}"
                             for kind, names in info.provides.items())
        if info.details:
            provides = (provides + "; " if provides else "") + "; ".join(info.details)
        status = Text(info.status, style=styles.get(info.status, ""))
        table.add_row(name, status, Text(provides))
    console.print(table)
    # reasons go below the table, one plain line each, so they are never cut by a narrow terminal
    for info in infos:
        if info.status != "ok" and info.reason:
            line = f"{info.name} ({info.status}): {info.reason}" + (f" — fix: {info.fix}" if info.fix else "")
            console.print(Text(line))
    for scope, (plugin, result) in plugins.unavailable_scopes.items():
        console.print(Text(f"{scope} (plugin {plugin}) is unavailable: {result.reason}"
                           + (f" — fix: {result.fix}" if result.fix else "")))


def _names(kind: str, names: list[str], unavailable: dict) -> str:
    """A plugin's names of one kind, short: config fields grouped by their section (``training.{a, b}``),
    a task or backend that cannot run marked ``(unavailable)``."""
    if kind == "config fields":
        sections: dict[str, list[str]] = {}
        for name in names:
            head, _, leaf = name.rpartition(".")
            sections.setdefault(head, []).append(leaf)
        return ", ".join(f"{head}.{{{_leaves(leaves)}}}" if head and len(leaves) > 1 else
                         (f"{head}.{leaves[0]}" if head else leaves[0]) for head, leaves in sections.items())
    scope = {"tasks": "task", "backends": "backend"}.get(kind)
    return ", ".join(f"{n} (unavailable)" if scope and f"{scope}:{n}" in unavailable else n for n in names)


def _leaves(leaves: list[str]) -> str:
    """Leaf names, a family of four or more sharing two words (``reward_hack_*``) shown once with its count
    (the full names: ``soup plugins list --json``)."""
    families: dict[str, list[str]] = {}
    for leaf in leaves:
        parts = leaf.split("_")
        families.setdefault("_".join(parts[:2]) if len(parts) > 2 else leaf, []).append(leaf)
    shown: list[str] = []
    for prefix, members in families.items():
        shown += [f"{prefix}_* ({len(members)})"] if len(members) >= 4 else members
    return ", ".join(shown)
