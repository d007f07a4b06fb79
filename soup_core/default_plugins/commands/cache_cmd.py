"""``soup cache list|clear``: the prepared data Soup keeps under ``$SOUP_HOME/cache/data``, and the model
folders dequantised from GGUF bases under ``$SOUP_HOME/cache/gguf``."""

from __future__ import annotations

import time

import typer

cache_app = typer.Typer(help="See and clear the prepared data and the dequantised GGUF bases Soup caches.",
                        no_args_is_help=True)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


@cache_app.command("list")
def list_cache() -> None:
    """Every cached entry (most recently used first): its kind, size, last use and rows. Exit code 0."""
    from soup_core.data.cache import cache_root, entries, limit_bytes

    listed = entries()
    total = sum(e["bytes"] for e in listed)
    typer.echo(f"{cache_root()}: {_n(len(listed), *ENTRIES)}, {_size(total)} of {_size(limit_bytes())} "
               "(SOUP_DATA_CACHE_GB sets the limit)")
    for entry in listed:
        parts = entry["parts"]
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry["used"]))
        if entry["kind"] == "rows":  # the training list of some data files
            what = "rows of " + ", ".join(str(f[0]) for f in parts.get("files", []))
        else:
            task = parts.get("task") or ["?"]
            what = f"task {task[0]}, max_length {parts.get('data', {}).get('max_length', '?')}"
        typer.echo(f"  {entry['name']}  {entry['kind']:<8} {_size(entry['bytes']):>9}  used {used}  {what}")
    from soup_core.default_plugins.transformers import gguf

    bases = gguf.entries()
    typer.echo(f"{gguf.cache_root()}: {_n(len(bases), *BASES)}, "
               f"{_size(sum(e['bytes'] for e in bases))}")
    for entry in bases:
        built = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.get("built") or 0))
        typer.echo(f"  {entry['name']}  {entry.get('dtype', '?'):<8} {_size(entry['bytes']):>9}  built {built}  "
                   f"from {entry.get('path', '?')}")


@cache_app.command("clear")
def clear_cache() -> None:
    """Remove every cached entry and dequantised GGUF base; the next run prepares its data (and dequantises
    its GGUF base) again. An entry or GGUF base a running process is writing or reading is skipped, and named
    with its pids. Exit code 0."""
    from soup_core.data.cache import cache_root, clear
    from soup_core.default_plugins.transformers import gguf

    n, freed, skipped = clear()
    typer.echo(f"removed {_n(n, *ENTRIES)} ({_size(freed)}) from {cache_root()}")
    _skipped(skipped, ENTRIES)
    n, freed, skipped = gguf.clear()
    typer.echo(f"removed {_n(n, *BASES)} ({_size(freed)}) from {gguf.cache_root()}")
    _skipped(skipped, BASES)


ENTRIES, BASES = ("entry", "entries"), ("dequantised GGUF base", "dequantised GGUF bases")


def _n(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _skipped(skipped: dict[str, list[int]], what: tuple[str, str]) -> None:
    if skipped:
        pids = sorted({pid for users in skipped.values() for pid in users})
        by = f" by pid {', '.join(map(str, pids))}" if pids else ""
        typer.echo(f"skipped {_n(len(skipped), *what)} in use{by}: {', '.join(sorted(skipped))}")
