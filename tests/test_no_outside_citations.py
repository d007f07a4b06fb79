"""No source file, doc or config in the repository cites a document outside it (a design note, shared
notes): what the code needs of the design lives in docs/ (docs/architecture.md)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"DESIGN\.md|\.\./shared/|ENVIRONMENT\.md|shared/seeds|upstream-behaviour|§\s*\d")


def citations(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if OUTSIDE.search(line)]


def test_no_file_cites_a_document_outside_the_repository() -> None:
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.toml", "*.txt", "*.yaml", "scripts/*"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert len(files) > 100
    found = {
        f: hits
        for f in files
        if f != "tests/test_no_outside_citations.py"
        and (ROOT / f).is_file()
        and (hits := citations((ROOT / f).read_text(encoding="utf-8", errors="replace")))
    }
    assert found == {}


def test_control_a_citation_is_found() -> None:
    assert citations('"""Registration is cheap (DESIGN.md §3)."""\nx = 1\n') == [
        '"""Registration is cheap (DESIGN.md §3)."""'
    ]
