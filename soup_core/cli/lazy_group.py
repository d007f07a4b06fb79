"""The root ``soup`` group: a plugin's command is turned into a click command only when it is used.

typer inspects every command's signature and type hints when it builds the group, which is a third of
``soup --help``'s own start-up and grows with each plugin's commands. Here ``soup --help`` lists names
and short help from the :class:`~soup_core.contracts.Command` records, and ``soup NAME`` builds the
one command it runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, ClassVar

import typer
from typer._click import ClickException
from typer.core import TyperGroup

from soup_core.contracts import Command


def to_click(command: Command) -> Any:
    """The click command (or group) typer builds for one ``Command`` record."""
    target = command.target
    if isinstance(target, typer.Typer):
        holder = typer.Typer(add_completion=False)
        holder.add_typer(target, name=command.name, help=command.help or None)
        return typer.main.get_group(holder).commands[command.name]
    single = typer.Typer(add_completion=False)
    single.command(name=command.name, help=command.help or None)(target)
    return typer.main.get_command(single)


class LazyCommands(MutableMapping[str, Any]):
    """Name -> click command, built on first lookup; keys and order are known without building. A record
    named ``GROUP NAME`` joins the group ``GROUP`` (another plugin's, say) as ``NAME`` when that is built."""

    def __init__(self, records: Mapping[str, Command], built: MutableMapping[str, Any]) -> None:
        self._records = {name: cmd for name, cmd in records.items() if " " not in name}
        self._joining = [cmd for name, cmd in records.items() if " " in name]
        self._built = built

    def _build(self, name: str) -> Any:
        command = to_click(self._records[name])
        for record in self._joining:
            group, _, leaf = record.name.partition(" ")
            if group != name:
                continue
            if not hasattr(command, "add_command") or leaf in command.commands:
                raise ClickException(f"the command `soup {record.name}` cannot be added: `soup {name}` "
                                       f"{'is not a group' if not hasattr(command, 'add_command') else 'has it'}")
            command.add_command(to_click(record._replace(name=leaf)), leaf)
        return command

    def is_built(self, name: str) -> bool:
        return name in self._built

    def record(self, name: str) -> Command | None:
        return self._records.get(name)

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            if name not in self._records:
                raise KeyError(name)
            self._built[name] = self._build(name)
        return self._built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._built[name] = command

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self._records.pop(name, None)
        self._built.pop(name, None)  # a command not built yet has only its record

    def __iter__(self) -> Iterator[str]:
        yield from self._records
        yield from (name for name in self._built if name not in self._records)

    def __len__(self) -> int:
        return len(set(self._records) | set(self._built))

    def __contains__(self, name: object) -> bool:
        return name in self._records or name in self._built


class LazyGroup(TyperGroup):
    """A TyperGroup whose ``commands`` come from ``records`` (set on a subclass by :func:`group_class`)."""

    records: ClassVar[Mapping[str, Command]] = {}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commands = LazyCommands(self.records, built=dict(self.commands))

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)  # TyperGroup's reads .items(), which would build every command

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        from typer._click.utils import make_default_short_help

        commands = self.commands
        if not isinstance(commands, LazyCommands):
            return super().format_commands(ctx, formatter)
        names = self.list_commands(ctx)
        if not names:
            return None
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            record = commands.record(name)
            if record is not None and record.help and not commands.is_built(name):
                rows.append((name, make_default_short_help(record.help, limit)))
                continue
            cmd = commands[name]
            if not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
        return None


def group_class(records: Mapping[str, Command]) -> type[LazyGroup]:
    """A :class:`LazyGroup` subclass serving ``records`` (typer instantiates the class itself)."""
    return type("SoupGroup", (LazyGroup,), {"records": dict(records)})
