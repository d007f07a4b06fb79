"""The default plugin ``core.formats``: the four row formats chat, alpaca, prompt_completion and text,
registered through the same hook a third-party plugin uses.

Each turns a raw record into a normalised, JSON-serialisable example, or raises ``ValueError`` saying
what is wrong with the record. Keys a format does not use (``id``, ``source``, ...) are left out of the example
and named once in the run's plan, unless the run's task declares them in ``extra_keys`` (then the core keeps
them beside the format's keys: see ``soup_core.data.build``).

Normalised examples:

- ``chat`` → ``{"messages": [{"role": ..., "content": ...}, ...]}``
- ``alpaca`` → ``{"prompt": ..., "completion": ...}`` (the prompt is built with :func:`alpaca_prompt`)
- ``prompt_completion`` → ``{"prompt": ..., "completion": ...}``
- ``text`` → ``{"text": ...}``

Auto-detection looks only at which keys a record has, highest ``priority`` first: chat (40) > alpaca (30)
> prompt_completion (20) > text (10). A plugin format that overlaps one of these (prompt/completion/label
has prompt and completion) should take a priority above the one it overlaps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from soup_core.contracts import DataFormat
from soup_core.data.errors import type_name
from soup_core.hookspecs import hookimpl

SOUP_HOOK_API = (1, 1)
__all__ = ["BUILTIN_FORMATS", "CHAT_ROLES", "alpaca_prompt"]

CHAT_ROLES = ("system", "user", "assistant")

#: How an alpaca record's instruction and optional input become one prompt (part of the fingerprint:
#: changing it changes every alpaca data set's fingerprint).
ALPACA_INPUT_HEADER = "\n\nInput:\n"
#: Ends every alpaca prompt, so the answer (the completion, trained on) never runs into the question.
ALPACA_RESPONSE_HEADER = "\n\nResponse:\n"


def alpaca_prompt(instruction: str, input_text: str = "") -> str:
    """The prompt of an alpaca record: the instruction, then ``Input:`` and the input when there is one, then
    ``Response:``, after which the completion follows."""
    if input_text:
        return f"{instruction}{ALPACA_INPUT_HEADER}{input_text}{ALPACA_RESPONSE_HEADER}"
    return f"{instruction}{ALPACA_RESPONSE_HEADER}"


def _has(record: Mapping[str, Any], *keys: str) -> bool:
    return all(key in record for key in keys)


def _keys_of(record: Mapping[str, Any]) -> str:
    keys = ", ".join(sorted(str(k) for k in record))
    return keys or "none"


def _require(record: Mapping[str, Any], fmt: str, needed: str, *keys: str) -> None:
    if all(key in record for key in keys):
        return
    missing = [key for key in keys if key not in record]
    names = " and ".join(repr(k) for k in missing)
    word = "keys" if len(missing) > 1 else "key"
    raise ValueError(f"missing {word} {names} (format {fmt} needs {needed}); the record has keys: {_keys_of(record)}")


def _string(record: Mapping[str, Any], key: str, *, non_empty: bool) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"'{key}' must be a string, got {type_name(value)}")
    if non_empty and not value.strip():
        raise ValueError(f"'{key}' is empty")
    return value


# ------------------------------------------------------------------------------------------------ chat


def _chat_detect(record: Mapping[str, Any]) -> bool:
    return "messages" in record


def _chat_to_example(record: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a chat record.

    Rules: ``messages`` is a non-empty list of ``{role, content}`` objects; ``role`` is system, user or
    assistant; ``content`` is a string; a system message may only come first; the conversation does not
    open with an assistant message; at least one assistant message has non-empty content (there is
    something to train on). Turns need not alternate. Other keys of a message (``name``, ...) are dropped.
    """
    _require(record, "chat", "'messages'", "messages")
    messages = record["messages"]
    if not isinstance(messages, list):
        raise ValueError(f"'messages' must be a list of {{role, content}} objects, got {type_name(messages)}")
    if not messages:
        raise ValueError("'messages' is empty")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, (dict, Mapping)):  # dict first: the ABC check is slow per message
            raise ValueError(f"messages[{i}] must be a {{role, content}} object, got {type_name(message)}")
        if "role" not in message or "content" not in message:
            missing = "role" if "role" not in message else "content"
            raise ValueError(f"messages[{i}] has no '{missing}' (keys: {_keys_of(message)})")
        role, content = message["role"], message["content"]
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type_name(content)}")
        if role == "system" and i > 0:
            raise ValueError(f"messages[{i}]: a system message may only be the first message")
        out.append({"role": role, "content": content})
    if out[0]["role"] == "assistant":
        raise ValueError(
            "messages[0]: the conversation opens with an assistant message; put a user or system message before it"
        )
    answers = [m for m in out if m["role"] == "assistant"]
    if not answers:
        raise ValueError("no assistant message: a chat row needs at least one {role: assistant} message to train on")
    if not any(m["content"].strip() for m in answers):
        raise ValueError("every assistant message is empty")
    return {"messages": out}


# ---------------------------------------------------------------------------------------------- alpaca


def _alpaca_detect(record: Mapping[str, Any]) -> bool:
    return _has(record, "instruction", "output")


def _alpaca_to_example(record: Mapping[str, Any]) -> dict[str, Any]:
    """``instruction`` (non-empty string), optional ``input`` (string or null), ``output`` (non-empty)."""
    _require(record, "alpaca", "'instruction', 'output' and an optional 'input'", "instruction", "output")
    instruction = _string(record, "instruction", non_empty=True)
    input_text = record.get("input")
    if input_text is None:
        input_text = ""
    elif not isinstance(input_text, str):
        raise ValueError(f"'input' must be a string, got {type_name(input_text)}")
    output = _string(record, "output", non_empty=True)
    return {"prompt": alpaca_prompt(instruction, input_text), "completion": output}


# ------------------------------------------------------------------------------------ prompt/completion


def _pc_detect(record: Mapping[str, Any]) -> bool:
    return _has(record, "prompt", "completion")


def _pc_to_example(record: Mapping[str, Any]) -> dict[str, Any]:
    """``prompt`` (a string, may be empty) and ``completion`` (a non-empty string)."""
    _require(record, "prompt_completion", "'prompt' and 'completion'", "prompt", "completion")
    prompt = _string(record, "prompt", non_empty=False)
    completion = _string(record, "completion", non_empty=True)
    return {"prompt": prompt, "completion": completion}


# ------------------------------------------------------------------------------------------------ text


def _text_detect(record: Mapping[str, Any]) -> bool:
    return "text" in record


def _text_to_example(record: Mapping[str, Any]) -> dict[str, Any]:
    """``text``: a non-empty string, trained on as a whole."""
    _require(record, "text", "'text'", "text")
    return {"text": _string(record, "text", non_empty=True)}


BUILTIN_FORMATS: list[DataFormat] = [
    DataFormat(
        name="chat",
        keys=("messages",),
        detect=_chat_detect,
        to_example=_chat_to_example,
        description="conversations: messages = [{role: system|user|assistant, content}, ...]",
        priority=40,
    ),
    DataFormat(
        name="alpaca",
        keys=("instruction", "output"),
        detect=_alpaca_detect,
        to_example=_alpaca_to_example,
        description="instruction, optional input, output",
        priority=30,
        reads=("input",),
    ),
    DataFormat(
        name="prompt_completion",
        keys=("prompt", "completion"),
        detect=_pc_detect,
        to_example=_pc_to_example,
        description="prompt and completion; the loss is on the completion",
        priority=20,
    ),
    DataFormat(
        name="text",
        keys=("text",),
        detect=_text_detect,
        to_example=_text_to_example,
        description="plain text, trained on as a whole",
        priority=10,
    ),
]


@hookimpl
def soup_register_data_formats() -> list[DataFormat]:
    """chat, alpaca, prompt_completion and text."""
    return list(BUILTIN_FORMATS)
