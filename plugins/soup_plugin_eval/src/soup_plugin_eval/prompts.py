"""Prompts as the run trained them: the prompt side of a training row, or a typed prompt in the run's format.

- a chat row: its messages up to the last non-assistant turn, rendered by the run's chat template with the
  generation prompt (what the model saw before the answer it was trained on);
- a prompt/completion or alpaca row: the prompt's tokens, as ``encode_example`` tokenises them in training;
- a text row: the text's tokens (the model continues it).

A typed prompt (``--prompt``, a chat line) becomes a user message for a run trained on chat rows, an alpaca
prompt for an alpaca run, and a plain prompt otherwise. Pure Python: the tokenizer is passed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class PromptError(ValueError):
    """A prompt that cannot be rendered as the run trained (the message says which and why)."""


@dataclass
class Prompt:
    index: int  # the row's index in the input (or the --prompt's position)
    ids: list[int]
    text: str  # what the user gave: the prompt, or the row's last user turn
    reference: str | None = None  # the answer the row holds, when it has one


def _ids(encoding: Any) -> list[int]:
    ids = encoding["input_ids"] if isinstance(encoding, Mapping) or hasattr(encoding, "keys") else encoding
    return [int(i) for i in ids]


def chat_ids(messages: Sequence[Mapping[str, str]], tokenizer: Any) -> list[int]:
    """The chat template's rendering of ``messages`` with the generation prompt, as token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("the run trained on chat rows but its tokenizer has no chat template")
    rendered = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=True, return_dict=True,
                                             add_generation_prompt=True)
    return _ids(rendered)


def plain_ids(prompt: str, tokenizer: Any) -> list[int]:
    """A prompt's tokens exactly as training tokenises a prompt/completion row's prompt."""
    ids = _ids(tokenizer(prompt, add_special_tokens=True)) if prompt else []
    if not ids and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id]
    return ids


def row_prompt(index: int, row: Mapping[str, Any], tokenizer: Any) -> Prompt:
    """The prompt side of one normalised training row."""
    if "messages" in row:
        messages = list(row["messages"])
        cut = len(messages)
        while cut and messages[cut - 1]["role"] == "assistant":
            cut -= 1
        if cut == 0:
            raise PromptError(f"row {index}: a conversation with no user turn has no prompt side")
        answer = "".join(m["content"] for m in messages[cut:]) or None
        return Prompt(index, chat_ids(messages[:cut], tokenizer), messages[cut - 1]["content"], answer)
    if "prompt" in row:
        return Prompt(index, plain_ids(row["prompt"], tokenizer), row["prompt"], row.get("completion"))
    if "text" in row:
        return Prompt(index, plain_ids(row["text"], tokenizer), row["text"])
    raise PromptError(f"row {index}: no messages, prompt or text to generate from (keys: {', '.join(sorted(row))})")


def typed_prompt(index: int, text: str, tokenizer: Any, *, data_format: str | None,
                 system: str | None = None) -> Prompt:
    """A prompt typed by the user, rendered in the run's format."""
    if data_format == "chat":
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return Prompt(index, chat_ids(messages, tokenizer), text)
    if system:
        raise PromptError("--system needs a run trained on chat rows (this one trained on "
                          f"{data_format or 'non-chat'} rows)")
    if data_format == "alpaca":
        from soup_core.default_plugins.formats import alpaca_prompt

        return Prompt(index, plain_ids(alpaca_prompt(text), tokenizer), text)
    return Prompt(index, plain_ids(text, tokenizer), text)


def read_rows(path: Path, plugins: Any) -> tuple[list[dict[str, Any]], str]:
    """Every row of a data file in any format Soup trains on (normalised), and the format found."""
    from soup_core.data import build_training_list

    data = {"train": str(path), "format": "auto", "val_split": 0.0, "on_bad_row": "error"}
    rows = build_training_list(data, formats=plugins.data_formats)
    return rows.rows, rows.format
