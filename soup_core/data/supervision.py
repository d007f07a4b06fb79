"""Rows that train nothing: encoded rows left without a supervised token (every label ``-100``), most often
because ``data.max_length`` cut the answer off.

Such a row stays in place (row indices never shift) but contributes no loss. Under ``data.on_bad_row: error``
it is an error naming the rows; under ``skip`` it is counted. No supervised token at all is always refused:
a run on it would log a loss of 0, finish, and train nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from soup_core.data.errors import DataError

IGNORE = -100  # the label value a loss skips
_NAMED = 5  # rows named in a message before "and N more"


def unsupervised_rows(encoded: Sequence[Mapping[str, Any]]) -> list[int]:
    """Positions of encoded rows whose ``labels`` hold no supervised token; [] when rows carry no labels
    (a task whose objective is not next-token prediction on labels)."""
    return [
        i for i, example in enumerate(encoded)
        if "labels" in example and list(example["labels"]).count(IGNORE) == len(example["labels"])
    ]  # count() runs in C: a million rows of labels take a generator per token far longer


def _where(training: Any, index: int) -> str:
    origin = training.origin(index) if hasattr(training, "origin") else None
    return f"row {index} ({origin[0]} line {origin[1]})" if origin else f"row {index}"


def check_supervision(
    encoded: Sequence[Mapping[str, Any]], *, training: Any, max_length: int, on_bad_row: str,
    empty: Sequence[int] | None = None,
) -> list[int]:
    """Check the encoded training rows; returns the rows skipped (no supervised token) under ``skip``.

    Raises DataError when every row trains nothing (always), or when some do under ``on_bad_row: error``.
    ``training`` is the TrainingList the rows came from (for the file and line of each row). ``empty``: the
    rows without a supervised token when already known (prepared data counts them as it encodes).
    """
    if empty is None:
        if not encoded or not any("labels" in example for example in encoded):
            return []
        empty = unsupervised_rows(encoded)
    empty = list(empty)
    if len(empty) == len(encoded):
        raise DataError(
            "", None,
            f"no training row has a supervised token left at data.max_length={max_length} (all "
            f"{len(encoded)} rows): training would log a loss of 0 and change nothing",
            fix="raise data.max_length, or shorten the prompts so the answers fit",
        )
    if empty and on_bad_row != "skip":
        named = ", ".join(_where(training, i) for i in empty[:_NAMED])
        more = f" and {len(empty) - _NAMED} more" if len(empty) > _NAMED else ""
        raise DataError(
            "", None,
            f"{len(empty)} of {len(encoded)} training rows have no supervised token left at "
            f"data.max_length={max_length}: {named}{more}",
            fix="raise data.max_length, shorten those rows, or set data.on_bad_row: skip to skip them",
        )
    return empty
