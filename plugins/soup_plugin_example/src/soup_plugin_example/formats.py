"""The ``weighted`` data format: a prompt/completion, text or chat record with a ``weight``.

Pure Python (``soup rewind`` rebuilds training rows without torch). The normalised example keeps the
record's shape and adds the weight as a float::

    {"prompt": "2+2=", "completion": "4", "weight": 2.0}
    {"text": "a plain document", "weight": 0.5}
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "weight": 1}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from soup_core import DataFormat

NAME = "weighted"
ROLES = ("system", "user", "assistant")
_SHAPES = "prompt and completion, text, or messages"


def _keys(record: Mapping[str, Any]) -> str:
    return ", ".join(sorted(map(str, record))) or "none"


def _weight(record: Mapping[str, Any]) -> float:
    if "weight" not in record:
        raise ValueError(f"missing key 'weight' (format {NAME} needs a number >= 0 beside {_SHAPES}); "
                         f"the record has keys: {_keys(record)}")
    value = record["weight"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"'weight' must be a number >= 0, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"'weight' must be a finite number >= 0, got {value!r}")
    return float(value)


def _string(record: Mapping[str, Any], key: str, *, empty_ok: bool = False) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {type(value).__name__}")
    if not empty_ok and not value.strip():
        raise ValueError(f"{key!r} is empty")
    return value


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] needs a role among {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
        out.append({"role": message["role"], "content": message["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("'messages' has no assistant turn to train on")
    return out


def to_example(record: Mapping[str, Any]) -> dict[str, Any]:
    """The normalised example, or ValueError saying what is wrong with the record."""
    weight = _weight(record)
    if "messages" in record:
        return {"messages": _messages(record["messages"]), "weight": weight}
    if "prompt" in record or "completion" in record:
        if "completion" not in record or "prompt" not in record:
            missing = "completion" if "prompt" in record else "prompt"
            raise ValueError(f"missing key {missing!r} (format {NAME} needs {_SHAPES}); the record has keys: "
                             f"{_keys(record)}")
        prompt = _string(record, "prompt", empty_ok=True)
        return {"prompt": prompt, "completion": _string(record, "completion"), "weight": weight}
    if "text" in record:
        return {"text": _string(record, "text"), "weight": weight}
    raise ValueError(f"format {NAME} needs {_SHAPES} beside 'weight'; the record has keys: {_keys(record)}")


def detect(record: Mapping[str, Any]) -> bool:
    """A record with a weight and one of the shapes (used by ``data.format: auto``)."""
    return "weight" in record and (
        "messages" in record or ("prompt" in record and "completion" in record) or "text" in record
    )


WEIGHTED = DataFormat(
    name=NAME,
    keys=("weight", "prompt", "completion"),
    detect=detect,
    to_example=to_example,
    description="a prompt/completion, text or chat row with a loss weight (a number >= 0)",
    priority=50,  # above chat (40): a weighted chat row is this format, not plain chat
)
