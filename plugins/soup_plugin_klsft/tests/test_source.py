"""The plugin is the one ``docs/plugins.md`` shows (walk-through 3), in at most 60 lines of Python, as stated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]
DOCS = HERE.parents[1] / "docs" / "plugins.md"
in_repo = pytest.mark.skipif(not DOCS.is_file(), reason="docs/plugins.md is in the repository, not in a wheel")


def shown(heading: str) -> str:
    """The first code block under the walk-through-3 heading that names ``heading``."""
    section = DOCS.read_text(encoding="utf-8").split("## Walk-through 3", 1)[1].split("\n## ", 1)[0]
    after = section.split(f"(`{heading}`)", 1)[1]
    return re.search(r"```\w*\n(.*?)```", after, re.S).group(1)


def lines() -> int:
    return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in (HERE / "src").rglob("*.py"))


@in_repo
@pytest.mark.parametrize("path", ["src/soup_plugin_klsft/plugin.py", "src/soup_plugin_klsft/trainer.py"])
def test_the_docs_show_the_source_as_it_is(path: str) -> None:
    assert shown(path) == (HERE / path).read_text(encoding="utf-8")


@in_repo
def test_the_docs_show_the_distribution_as_it_is() -> None:
    assert (HERE / "pyproject.toml").read_text(encoding="utf-8").startswith(shown("pyproject.toml"))


def test_at_most_60_lines_of_python_as_the_docs_and_readme_say() -> None:
    assert 0 < lines() <= 60
    assert f"in {lines()} lines of Python" in (HERE / "README.md").read_text(encoding="utf-8")
    if DOCS.is_file():
        assert f"in {lines()} lines of Python" in DOCS.read_text(encoding="utf-8").split("## Walk-through 3", 1)[1]
