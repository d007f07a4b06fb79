"""Registries keyed by name that refuse duplicates and remember which plugin registered what."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class DuplicateNameError(ValueError):
    """Two plugins registered the same name in one registry."""

    def __init__(self, kind: str, name: str, first: str, second: str) -> None:
        self.kind, self.name, self.first, self.second = kind, name, first, second
        super().__init__(
            f"{kind} {name!r} is provided by both plugin {first!r} and plugin {second!r}; "
            f"uninstall or disable one of them (soup -p no:{second} …)"
        )


class Registry(Mapping[str, T], Generic[T]):
    """An ordered name → object mapping; ``owner(name)`` is the plugin that registered it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._owners: dict[str, str] = {}

    def add(self, name: str, obj: T, plugin: str) -> None:
        if name in self._items:
            raise DuplicateNameError(self.kind, name, self._owners[name], plugin)
        self._items[name] = obj
        self._owners[name] = plugin

    def owner(self, name: str) -> str:
        return self._owners[name]

    def by_plugin(self, plugin: str) -> list[str]:
        return [name for name, owner in self._owners.items() if owner == plugin]

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {', '.join(self._items)})"
