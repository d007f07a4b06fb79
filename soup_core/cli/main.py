"""The ``soup`` command: a typer app whose commands come from plugins (built-ins included).

Start-up stays light: this module imports typer and the plugin manager only. Commands import what they
need when they run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

# Plain click help and errors: typer's rich help pulls in rich.markdown and pygments (~0.1 s), a third
# of the start-up budget. TYPER_USE_RICH=1 brings the rich help back.
os.environ.setdefault("TYPER_USE_RICH", "0")

import typer  # noqa: E402

EXIT_CODES_HELP = (
    "Exit codes: 0 success; 1 the command failed (bad config, bad data, run failed, nothing found); "
    "2 usage error; 130 interrupted (Ctrl-C); 143 interrupted by SIGTERM (soup train)."
)


def _take_plugin_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """Pull ``-p no:NAME`` / ``-p=no:NAME`` out of the global options (before the command name)."""
    disabled: list[str] = []
    rest: list[str] = []
    i = 0
    in_globals = True
    while i < len(argv):
        arg = argv[i]
        if in_globals and arg in ("-p", "--plugin") and i + 1 < len(argv):
            value = argv[i + 1]
            i += 2
        elif in_globals and (arg.startswith("-p=") or arg.startswith("--plugin=")):
            value = arg.split("=", 1)[1]
            i += 1
        else:
            if not arg.startswith("-"):
                in_globals = False
            rest.append(arg)
            i += 1
            continue
        if not value.startswith("no:") or not value[3:]:
            raise typer.BadParameter(f"-p takes no:NAME to disable a plugin, got {value!r}")
        disabled.append(value[3:])
    return rest, disabled


def _version_line() -> str:
    from soup_core import __version__
    from soup_core.plugins import load_plugins

    plugins = load_plugins()
    parts = []
    for info in plugins.plugins.values():
        if info.builtin:
            continue
        mark = "" if info.status == "ok" else f" ({info.status})"
        parts.append(f"{info.name} {info.version}{mark}")
    return f"soup-core {__version__}\nplugins: {', '.join(parts) if parts else 'none'}"


def build_app(*, help_only: bool = False) -> typer.Typer:
    """Build the typer app from the loaded plugin set's commands (each built when it is used). For the
    top-level help alone (``help_only``) the plugins' soup-core ranges are not read: that needs
    ``packaging``, which ``soup --help`` must not import; every command checks them."""
    from soup_core.cli.lazy_group import group_class
    from soup_core.plugins import load_plugins

    plugins = load_plugins(check_ranges=not help_only)
    app = typer.Typer(
        cls=group_class(dict(plugins.commands.items())),
        name="soup",
        help="Fine-tune and post-train language models from one YAML file and one command.\n\n"
        + EXIT_CODES_HELP,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    @app.callback()
    def _globals(
        version: bool = typer.Option(False, "--version", help="Print the core version and the plugins."),
        plugin: list[str] = typer.Option(  # noqa: B006 - typer reads the default
            [], "-p", "--plugin", metavar="no:NAME", help="Disable the plugin NAME for this command."
        ),
    ) -> None:
        """Fine-tune and post-train language models from one YAML file and one command."""
        if version:
            typer.echo(_version_line())
            raise typer.Exit(0)

    return app


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point. Called with ``argv`` (tests, other programs) it returns or raises ``SystemExit``;
    as the ``soup`` command (no ``argv``) it ends the process with the command's exit code."""
    if argv is not None:
        return _run(argv)
    try:
        _run(None)
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    _leave(code)


def _leave(code: object) -> None:
    """End the process without tearing the interpreter down: with torch and transformers loaded, clearing
    every module and collecting their objects costs about a second of CPU that the OS reclaims at once. What
    a normal exit would still do happens: the ``atexit`` handlers run (logging, trackers, multiprocessing)
    and the standard streams are flushed; a live non-daemon thread gets the normal exit, which waits for it."""
    import atexit
    import threading

    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if run_exitfuncs is None or any(t.is_alive() for t in others):
        raise SystemExit(code)
    if code is not None and not isinstance(code, int):  # SystemExit("message"), as Python prints it
        print(code, file=sys.stderr)
        code = 1
    run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (soup ... | head) or stream: nothing left to write
            pass
    os._exit(code or 0)


def _run(argv: Sequence[str] | None) -> None:
    from soup_core.plugins import load_plugins, manager

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        args, disabled = _take_plugin_options(args)
    except typer.BadParameter as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    manager.CLI_DISABLED[:] = disabled
    if args and args[0] == "--version":
        try:
            print(_version_line())
        except manager.PluginLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        return
    try:
        app = build_app(help_only=not args or args[0] in ("-h", "--help"))
    except manager.PluginLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if args and args[0] not in ("plugins", "init", "doctor") and not {"-h", "--help"} & set(args) \
            and args[0] in load_plugins().commands:  # every command that uses SOUP_HOME, before it reads there
        from soup_core.tracker.store import home_problem

        if problem := home_problem():
            print(f"error: {problem[0]}\n  fix: {problem[1]}", file=sys.stderr)
            raise SystemExit(1)
    try:
        app(args=args, prog_name="soup", standalone_mode=True)
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
