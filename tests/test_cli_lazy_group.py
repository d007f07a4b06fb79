"""The root group builds a command only when it is used, and says the same as an eagerly built group."""

from __future__ import annotations

import copy

import pytest
import typer
from typer.testing import CliRunner

from soup_core.cli.lazy_group import LazyCommands
from soup_core.cli.main import build_app
from soup_core.contracts import Command
from soup_core.plugins import load_plugins


@pytest.fixture(autouse=True)
def plain_help(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain click help ``soup`` uses (TYPER_USE_RICH=0), whatever imported typer first in this process."""
    import typer.core

    monkeypatch.setattr(typer.core, "HAS_RICH", False)


def _eager_app() -> typer.Typer:
    """What typer builds when every command is registered up front (the app before it was lazy)."""
    lazy = build_app()
    app = typer.Typer(
        name="soup", help=lazy.info.help, no_args_is_help=True, add_completion=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.registered_callback = lazy.registered_callback
    records = load_plugins().commands
    for name, command in records.items():
        if " " in name:  # joins its group, below
            continue
        if isinstance(command.target, typer.Typer):
            group = copy.copy(command.target)  # the plugin's own group stays as it is
            group.registered_commands = list(command.target.registered_commands)
            for joining in (c for n, c in records.items() if n.startswith(name + " ")):
                group.command(name=joining.name.split(" ", 1)[1], help=joining.help or None)(joining.target)
            app.add_typer(group, name=name, help=command.help or None)
        else:
            app.command(name=name, help=command.help or None)(command.target)
    return app


def test_help_lists_every_command_as_the_eager_group_does() -> None:
    runner = CliRunner()
    lazy = runner.invoke(build_app(), ["--help"], prog_name="soup")
    eager = runner.invoke(_eager_app(), ["--help"], prog_name="soup")
    assert lazy.exit_code == eager.exit_code == 0
    # the same lines; the lazy group keeps the plugins' registration order (typer lists groups last)
    assert sorted(lazy.output.splitlines()) == sorted(eager.output.splitlines())
    assert "train" in lazy.output and "plugins" in lazy.output


def _run(group, args: list[str]) -> None:
    try:
        group.main(args=args, prog_name="soup", standalone_mode=True)
    except SystemExit as exc:
        assert exc.code == 0


def test_help_builds_no_command_and_running_one_builds_only_it(capsys) -> None:
    group = typer.main.get_command(build_app())
    commands = group.commands
    assert isinstance(commands, LazyCommands)
    _run(group, ["--help"])
    assert [name for name in commands if commands.is_built(name)] == []
    _run(group, ["init", "--help"])
    assert "Usage: soup init" in capsys.readouterr().out
    assert [name for name in commands if commands.is_built(name)] == ["init"]  # control: it does build


def test_each_command_help_matches_the_eager_build() -> None:
    runner = CliRunner()
    lazy, eager = build_app(), _eager_app()
    for name in load_plugins().commands:
        a = runner.invoke(lazy, [*name.split(), "--help"], prog_name="soup")
        b = runner.invoke(eager, [*name.split(), "--help"], prog_name="soup")
        assert (a.exit_code, a.output) == (b.exit_code, b.output), name


def test_a_typo_still_gets_a_suggestion() -> None:
    result = CliRunner().invoke(build_app(), ["trian"], prog_name="soup")
    assert result.exit_code == 2
    assert "Did you mean 'train'?" in result.output


def test_deleting_a_command_that_was_never_built() -> None:
    group = typer.main.get_command(build_app())
    commands = group.commands
    del commands["init"]
    assert "init" not in commands and "init" not in list(commands)
    with pytest.raises(KeyError):
        del commands["init"]


def _group_with(*records: Command) -> typer.Typer:
    from soup_core.cli.lazy_group import group_class

    app = typer.Typer(cls=group_class({r.name: r for r in records}), add_completion=False)
    app.callback()(lambda: None)
    return app


def test_a_command_named_group_and_name_joins_that_group() -> None:
    runs = typer.Typer()
    runs.command("list")(lambda: print("listed"))

    def plot(width: int = 1) -> None:
        print(f"plotted {width}")

    app = _group_with(Command("runs", runs), Command("runs plot", plot, "Draw runs."))
    runner = CliRunner()
    assert runner.invoke(app, ["runs", "plot", "--width", "3"]).output == "plotted 3\n"
    assert "plot" in runner.invoke(app, ["runs", "--help"]).output
    assert "runs plot" not in runner.invoke(app, ["--help"]).output  # not a command of its own
    # control: without the joining record, the group has no such command
    assert runner.invoke(_group_with(Command("runs", runs)), ["runs", "plot"]).exit_code == 2


def test_a_joining_command_the_group_has_already_is_refused() -> None:
    runs = typer.Typer()
    runs.command("list")(lambda: None)
    runs.command("show")(lambda: None)
    result = CliRunner().invoke(_group_with(Command("runs", runs), Command("runs show", lambda: None)),
                                ["runs", "show"])
    assert result.exit_code == 1 and "`soup runs show` cannot be added: `soup runs` has it" in result.output
