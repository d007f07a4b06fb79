"""``soup doctor``: the command. The checks live in :mod:`.doctor`, imported when it runs (every CLI start
imports this module to register the command)."""

from __future__ import annotations

import typer

DOCTOR_HELP = (
    "Check this machine and this installation: Python, platform, devices, soup distributions, plugins "
    "and their probes, every declared dependency against its range, and the third-party warnings Soup hides "
    "that this installation gives (what they mean for you).\n\n"
    "Exit codes: 0 every required dependency is installed and in range; 1 one is missing or out of "
    "range (the pip install line that fixes it is printed)."
)


def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
    quick: bool = typer.Option(False, "--quick", help="Skip the deep probes and the device checks (no torch "
                               "import)."),
) -> None:
    """Check this machine and this installation (see ``soup doctor --help``)."""
    import json

    from soup_core.default_plugins.commands.doctor import build_report, print_report

    report = build_report(deep=not quick, devices=not quick)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report)
    raise typer.Exit(1 if report.failed else 0)
