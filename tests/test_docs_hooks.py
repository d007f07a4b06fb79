"""docs/plugins.md's hook reference matches soup_core/hookspecs.py, so the docs cannot drift."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from soup_core import hookspecs

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def expected_lines() -> list[str]:
    lines = []
    for name, fn in vars(hookspecs).items():
        if not (name.startswith("soup_") and callable(fn)):
            continue
        params = ", ".join(inspect.signature(fn).parameters)
        first = inspect.getdoc(fn).splitlines()[0]
        opts = getattr(fn, "soup_spec", {}) or {}
        flag = " (firstresult)" if opts.get("firstresult") else ""
        lines.append(f"- `{name}({params})`{flag} — {first}")
    return lines


def documented_lines() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    block = re.search(r"<!-- hook-reference:start -->\n(.*?)<!-- hook-reference:end -->", text, re.S)
    assert block, "docs/plugins.md lost its hook-reference markers"
    return [ln for ln in block.group(1).splitlines() if ln.strip()]


def test_every_hook_is_documented_with_its_docstring() -> None:
    assert documented_lines() == expected_lines()


def test_the_check_fails_when_a_hook_is_missing() -> None:
    # control: dropping one documented hook must be detected
    assert documented_lines()[:-1] != expected_lines()


def test_every_hook_has_a_docstring_saying_when_and_what() -> None:
    for name, fn in vars(hookspecs).items():
        if name.startswith("soup_") and callable(fn):
            doc = inspect.getdoc(fn) or ""
            assert len(doc) > 60, f"{name} needs a docstring: when it is called, what it returns, what not to do"
