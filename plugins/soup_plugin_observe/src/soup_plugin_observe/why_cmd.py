"""``soup why [RUN]``: how a run ended, why, where it went wrong, the evidence, and what to change.

Module level imports typer only (every ``soup`` start imports it to register the command).
"""

from __future__ import annotations

import typer

WHY_HELP = """How a run ended and why, in plain words: the first step where it went wrong, the evidence (each
line naming where it came from) and what to change (a config key and a value to try).

RUN is a run id, a unique prefix of one, or latest (the default); or a crash bundle (soup-crash-RUN.tar.gz,
soup bundle), so a maintainer can read a user's report. --json prints the verdict for scripts.

Exit codes: 0 the verdict was printed (whatever it says); 1 no such run or bundle, or an unreadable one."""


def why(
    run: str = typer.Argument("latest", help="Run id, prefix, latest, or a crash bundle (.tar.gz)."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdict as JSON."),
) -> None:
    """How a run ended and why, and what to change (see ``soup why --help``)."""
    import json

    from soup_plugin_observe import say_error
    from soup_plugin_observe.diagnose import diagnose
    from soup_plugin_observe.facts import FactsError, load

    try:
        facts = load(run)
    except FactsError as exc:
        say_error(str(exc))
        raise typer.Exit(1) from None
    verdict = diagnose(facts)
    if as_json:
        typer.echo(json.dumps(verdict.to_json(), indent=1, default=str))
        return
    _print(verdict, facts)


def _print(verdict, facts) -> None:  # noqa: ANN001 - a Verdict and its RunFacts
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, soft_wrap=True)

    where = f" (from {facts.bundle})" if facts.source == "bundle" else ""
    console.print(f"[bold]run {escape(verdict.run_id)}[/]{escape(where)}: {escape(verdict.headline)}")
    if verdict.first_bad_step is not None:
        console.print(f"  first step where it went wrong: {verdict.first_bad_step}")
    if verdict.evidence:
        console.print("  evidence:")
        for item in verdict.evidence:
            console.print(f"    [dim]{escape(item['source'])}:[/] {escape(item['text'])}")
    others = [f for f in verdict.findings if f.kind != verdict.kind]
    for finding in others:
        console.print(f"  also: {escape(finding.text)}")
    curve = _curve(facts, max(20, min(80, console.width - 12)))
    if curve is not None:
        console.print(curve)
    if verdict.fix:
        named = f"{verdict.key}: {verdict.value}"
        key = escape(f" ({named})") if verdict.key and verdict.value is not None and named not in verdict.fix else ""
        console.print(f"[bold]what to change:[/] {escape(verdict.fix)}{key}")
    if verdict.bundle and verdict.kind in ("crashed", "out_of_memory") and facts.source != "bundle":
        console.print(f"crash bundle: {escape(verdict.bundle)} (attach it to a bug report)")


def _curve(facts, width: int):  # noqa: ANN001, ANN202 - RunFacts -> rich Text or None
    """The loss curve in the terminal, drawn as soup rewind --plot draws it (None without rewind or a loss)."""
    series = facts.series("loss")
    if len(series) < 2:
        return None
    try:
        from soup_plugin_rewind.render import text_plot
    except ImportError:
        return None
    return text_plot([s for s, _ in series], [v for _, v in series], facts.spikes(), width=width, height=6)
