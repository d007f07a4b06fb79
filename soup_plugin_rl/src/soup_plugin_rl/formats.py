"""The row formats the rl tasks read, registered through the core's data-format hook.

Pure Python (``soup rewind`` rebuilds training lists without torch). Each ``to_example`` returns the
normalised example or raises ``ValueError`` saying what is wrong with the record; keys a format does not
use (``id``, ``source``, ...) are ignored.

- ``prompt_answer`` (grpo): ``prompt`` and an optional ``answer`` → ``{"prompt", "answer"}`` (answer may
  be None; the accuracy reward needs it).
- ``preference`` (dpo, ipo, bco, cpo, simpo, orpo): ``prompt``, ``chosen``, ``rejected``.
- ``prompt_completion_label`` (kto): ``prompt``, ``completion``, ``label`` (true: desirable).

Priorities: a preference record also has a ``prompt``, and a labelled record is also a
prompt/completion record, so both rank above the core's ``prompt_completion`` (20).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from soup_core.contracts import DataFormat


def _keys_of(record: Mapping[str, Any]) -> str:
    return ", ".join(sorted(str(k) for k in record)) or "none"


def _require(record: Mapping[str, Any], fmt: str, *keys: str) -> None:
    missing = [key for key in keys if key not in record]
    if missing:
        names = " and ".join(repr(k) for k in missing)
        needs = ", ".join(repr(k) for k in keys)
        raise ValueError(
            f"missing {'keys' if len(missing) > 1 else 'key'} {names} (format {fmt} needs {needs}); "
            f"the record has keys: {_keys_of(record)}"
        )


def _text(record: Mapping[str, Any], key: str, *, non_empty: bool = True) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"'{key}' must be a string, got {type(value).__name__}")
    if non_empty and not value.strip():
        raise ValueError(f"'{key}' is empty")
    return value


# ------------------------------------------------------------------------------------------ prompt/answer


def _pa_detect(record: Mapping[str, Any]) -> bool:
    return "prompt" in record and not any(k in record for k in ("completion", "chosen", "rejected"))


def _pa_to_example(record: Mapping[str, Any]) -> dict[str, Any]:
    """``prompt`` (non-empty string) and optional ``answer`` (a string or a number, kept as text)."""
    _require(record, "prompt_answer", "prompt")
    prompt = _text(record, "prompt")
    answer = record.get("answer")
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"'answer' must be a string or a number, got {type(answer).__name__}")
        answer = str(answer)
    return {"prompt": prompt, "answer": answer}


# --------------------------------------------------------------------------------------------- preference


def _pref_detect(record: Mapping[str, Any]) -> bool:
    return all(k in record for k in ("prompt", "chosen", "rejected"))


def _pref_to_example(record: Mapping[str, Any]) -> dict[str, Any]:
    """``prompt`` (a string, may be empty), ``chosen`` and ``rejected`` (different non-empty strings)."""
    _require(record, "preference", "prompt", "chosen", "rejected")
    prompt = _text(record, "prompt", non_empty=False)
    chosen = _text(record, "chosen")
    rejected = _text(record, "rejected")
    if chosen == rejected:
        raise ValueError(
            "'chosen' and 'rejected' are the same text: a pair must differ to teach a preference"
        )
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


# -------------------------------------------------------------------------------- prompt/completion/label


def _pcl_detect(record: Mapping[str, Any]) -> bool:
    return all(k in record for k in ("prompt", "completion", "label"))


def _pcl_to_example(record: Mapping[str, Any]) -> dict[str, Any]:
    """``prompt`` (a string, may be empty), ``completion`` (non-empty) and ``label`` (true or false)."""
    _require(record, "prompt_completion_label", "prompt", "completion", "label")
    prompt = _text(record, "prompt", non_empty=False)
    completion = _text(record, "completion")
    label = record["label"]
    if not isinstance(label, bool):
        raise ValueError(f"'label' must be true (desirable) or false (undesirable), got {label!r}")
    return {"prompt": prompt, "completion": completion, "label": label}


FORMATS: list[DataFormat] = [
    DataFormat(
        name="prompt_answer",
        keys=("prompt", "answer"),
        detect=_pa_detect,
        to_example=_pa_to_example,
        description="a prompt to generate from, and optionally the answer the accuracy reward checks",
        priority=15,
    ),
    DataFormat(
        name="preference",
        keys=("prompt", "chosen", "rejected"),
        detect=_pref_detect,
        to_example=_pref_to_example,
        description="a prompt with a preferred (chosen) and a dispreferred (rejected) completion",
        priority=25,
    ),
    DataFormat(
        name="prompt_completion_label",
        keys=("prompt", "completion", "label"),
        detect=_pcl_detect,
        to_example=_pcl_to_example,
        description="a prompt and completion labelled desirable (true) or undesirable (false)",
        priority=22,
    ),
]
