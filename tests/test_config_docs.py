"""docs/config.md documents every core config field, and names no field that does not exist."""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from pathlib import Path

from soup_core.config import core_field_paths
from soup_core.config.known import KNOWN_FIELDS
from soup_core.config.schema import SoupConfig, iter_fields

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"
ROW = re.compile(r"^\| `([a-z_][a-z0-9_.]*)` \|", flags=re.M)
MENTION = re.compile(r"`((?:data|training)\.[a-z0-9_.*]+)`")
# Mistakes the page shows on purpose (in its error examples), and its placeholder for "any key".
SHOWN_AS_WRONG = {
    "training.max_length",
    "training.learnin_rate",
    "data.train.x",
    "training.x",
    "data.x",
    "training.lora.x",
}


def documented_rows(text: str) -> list[str]:
    """The paths in the first column of the field tables (rows like ``| `training.epochs` | ...``)."""
    return ROW.findall(text)


def paths_that_do_not_exist(text: str) -> set[str]:
    sections = {path for path, _, section in iter_fields(SoupConfig) if section is not None}
    from soup_core.default_plugins.transformers.plugin import soup_register_config_fields

    valid = set(core_field_paths()) | sections | {f.path for f in soup_register_config_fields()}
    return {
        path
        for path in set(MENTION.findall(text)) - valid - SHOWN_AS_WRONG
        if not any(fnmatchcase(path, pattern) or path == pattern for pattern in KNOWN_FIELDS)
    }


def test_every_core_field_has_exactly_one_row() -> None:
    rows = documented_rows(DOC.read_text(encoding="utf-8"))
    assert len(rows) == len(set(rows)), "a field is documented twice"
    assert set(rows) == set(core_field_paths())


def test_every_path_mentioned_exists() -> None:
    unknown = paths_that_do_not_exist(DOC.read_text(encoding="utf-8"))
    assert not unknown, f"docs/config.md names paths that do not exist: {sorted(unknown)}"


def test_the_checks_can_fail() -> None:
    # Controls: a page missing a row, or naming a made-up path, is caught.
    text = DOC.read_text(encoding="utf-8")
    without_epochs = re.sub(r"^\| `training\.epochs` \|.*\n", "", text, flags=re.M)
    assert set(documented_rows(without_epochs)) != set(core_field_paths())
    assert paths_that_do_not_exist(text + "\nSet `training.made_up` too.\n") == {"training.made_up"}
