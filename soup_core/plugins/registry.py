"""Registries keyed by name that refuse duplicates and remember which plugin registered what."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class DuplicateNameError(ValueError):
    """Two plugins registered the same name in one registry."""

    def __init__(self, kind: str, name: str, first: str, second: str) -> None:
        self.kind, self.name, self.first, self.second = kind, name, first, second
        super().__init__(f"{kind} {name!r} is provided by both plugin {first!r} and plugin {second!r}; "
                         f"uninstall or disable one of them (soup -p no:{second} …)")


class Registry(dict[str, T], Generic[T]):
    """An ordered name → object mapping, filled by :meth:`add` only; ``owner(name)`` is the plugin that
    registered it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self._owners: dict[str, str] = {}

    def add(self, name: str, obj: T, plugin: str) -> None:
        if name in self:
            raise DuplicateNameError(self.kind, name, self._owners[name], plugin)
        self[name] = obj
        self._owners[name] = plugin

    def owner(self, name: str) -> str:
        return self._owners[name]

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {', '.join(self)})"
