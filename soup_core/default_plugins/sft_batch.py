"""The sft task's encoding, a chunk of rows at a time: the chat template renders a chunk, the fast tokenizer
encodes it in one batched call (its own threads use every core), and the trained tokens are found from the
character spans of the answers with a binary search over the token offsets.

The result is, row for row, what :func:`soup_core.default_plugins.sft.encode_example` gives one row at a time
(``tests/test_sft_batch.py`` checks it on every format): that per-row function stays the definition, this is
the fast way to the same tokens. A row this path cannot take as it is (a chat template that renders an empty
conversation, a slow tokenizer without offsets) goes through the per-row function.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from operator import itemgetter
from typing import Any

IGNORE = -100
#: Rows rendered and tokenised together: big enough for the batched call to pay, small enough to report progress.
CHUNK = 1024

_START, _END = itemgetter(0), itemgetter(1)


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class EncodingError(ValueError):
    """A row cannot be tokenised as asked (says which row, why, and how to fix it)."""

    row: int | None = None  # the row's position in the chunk being encoded, when known
    detail: str = ""  # the message without "training row N: "

    def with_row(self, row: int) -> EncodingError:
        self.row = row
        return self


PREFIX_ERROR = (
    "the chat template renders a conversation's beginning differently from the whole conversation, so the "
    "assistant tokens cannot be found; use a chat template with {% generation %} markers, or set "
    "data.train_on_responses_only: false"
)


def has_generation_markers(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template marks assistant text with ``{% generation %}``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one is used
        template = template.get("default")
    return bool(template) and bool(_GENERATION_TAG.search(template))



def tokenize(tokenizer: Any, texts: list[str], *, add_special_tokens: bool, offsets: bool = False):
    """The ids (and character offsets) of each text, as ``tokenizer(texts, add_special_tokens=...)`` gives them.

    The tokenizer's own call on the first text sets its Rust backend as that call needs it (no padding, no
    truncation, how special tokens are split); the backend then encodes the rest in one call, which skips the
    per-row conversion to a ``BatchEncoding`` (a third of the time on short rows).
    """
    if not texts:
        return [], []
    first = tokenizer(texts[:1], add_special_tokens=add_special_tokens, return_offsets_mapping=offsets)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        enc = tokenizer(texts, add_special_tokens=add_special_tokens, return_offsets_mapping=offsets)
        return enc["input_ids"], (enc["offset_mapping"] if offsets else [])
    encodings = backend.encode_batch(texts[1:], add_special_tokens=add_special_tokens)
    ids = [first["input_ids"][0], *(e.ids for e in encodings)]
    return ids, ([first["offset_mapping"][0], *(e.offsets for e in encodings)] if offsets else [])


def _span_labels(ids: list[int], offsets: list[tuple[int, int]], spans: Iterable[tuple[int, int]]) -> list[int]:
    """``ids`` where a token overlaps one of ``spans`` (character ranges), else ``IGNORE``.

    A token ``(start, end)`` overlaps ``(s, e)`` when ``start < e and end > s``; token offsets only grow along
    a sequence, so the overlapping tokens of a span are one run, found by two binary searches.
    """
    labels = [IGNORE] * len(ids)
    for span_start, span_end in spans:
        lo = bisect_right(offsets, span_start, key=_END)
        hi = bisect_left(offsets, span_end, key=_START)
        if hi > lo:
            labels[lo:hi] = ids[lo:hi]
    return labels


def _render_with_spans(chats: list[list[dict[str, str]]], tokenizer: Any) -> tuple[list[str], list[list[Any]]]:
    """The chat template's text of each conversation and the character spans of its ``{% generation %}``
    parts, as ``apply_chat_template(..., return_assistant_tokens_mask=True)`` renders them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    texts, spans = render_jinja_template(
        conversations=chats,
        chat_template=tokenizer.get_chat_template(),
        return_assistant_tokens_mask=True,
        **tokenizer.special_tokens_map,
    )
    return list(texts), list(spans)


def _prefix_spans(chats: list[list[dict[str, str]]], texts: list[str], tokenizer: Any) -> list[list[tuple[int, int]]]:
    """The answer spans by rendering prefixes (templates without generation markers), as
    :func:`soup_core.default_plugins.sft._encode_chat_by_prefix` finds them, for a chunk at once."""
    turns = [(row, i) for row, chat in enumerate(chats) for i, m in enumerate(chat) if m["role"] == "assistant"]
    befores = tokenizer.apply_chat_template([chats[r][:i] for r, i in turns], tokenize=False,
                                            add_generation_prompt=True)
    uptos = tokenizer.apply_chat_template([chats[r][: i + 1] for r, i in turns], tokenize=False)
    spans: list[list[tuple[int, int]]] = [[] for _ in chats]
    for (row, _), before, upto in zip(turns, befores, uptos, strict=True):
        if not (texts[row].startswith(upto) and upto.startswith(before)):
            raise EncodingError(PREFIX_ERROR).with_row(row)
        spans[row].append((len(before), len(upto.rstrip())))
    return spans


def _encode_chats(chats: list[list[dict[str, str]]], tokenizer: Any, responses_only: bool, markers: bool):
    if responses_only and markers:
        texts, spans = _render_with_spans(chats, tokenizer)
    else:
        texts = list(tokenizer.apply_chat_template(chats, tokenize=False))
        spans = _prefix_spans(chats, texts, tokenizer) if responses_only else None
    all_ids, offsets = tokenize(tokenizer, texts, add_special_tokens=False, offsets=spans is not None)
    if spans is None:
        return [(ids, list(ids)) for ids in all_ids]
    return [(ids, _span_labels(ids, offsets[i], spans[i])) for i, ids in enumerate(all_ids)]


def _encode_prompt_completion(rows: list[Mapping[str, Any]], tokenizer: Any, responses_only: bool):
    prompts = [r["prompt"] for r in rows]
    nonempty = [p for p in prompts if p]
    prompt_ids = iter(tokenize(tokenizer, nonempty, add_special_tokens=True)[0])
    completions = tokenize(tokenizer, [r["completion"] for r in rows], add_special_tokens=False)[0]
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    out = []
    for prompt_text, completion in zip(prompts, completions, strict=True):
        prompt = list(next(prompt_ids)) if prompt_text else []
        completion = list(completion)
        if not prompt and bos is not None:
            prompt = [bos]
        if eos is not None and (not completion or completion[-1] != eos):
            completion.append(eos)
        labels = ([IGNORE] * len(prompt) if responses_only else list(prompt)) + completion
        out.append((prompt + completion, labels))
    return out


def _encode_texts(rows: list[Mapping[str, Any]], tokenizer: Any):
    eos = tokenizer.eos_token_id
    out = []
    for ids in tokenize(tokenizer, [r["text"] for r in rows], add_special_tokens=True)[0]:
        ids = list(ids)
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        out.append((ids, list(ids)))
    return out


def _kind(row: Mapping[str, Any]) -> str:
    if "messages" in row:
        chat = row["messages"]
        # the batched template call takes a non-empty list of {role, content} dicts; anything else goes row by row
        plain = isinstance(chat, list) and len(chat) > 0 and all(isinstance(m, dict) for m in chat)
        return "chat" if plain and chat[0].get("role") != "assistant" else "row"
    if "prompt" in row and "completion" in row:
        return "pc"
    return "text" if "text" in row else "row"


def encode_chunk(
    rows: Sequence[Mapping[str, Any]], tokenizer: Any, *, max_length: int, train_on_responses_only: bool = True,
    per_row: Callable[..., Any],
) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` of each row, as ``per_row`` (:func:`~soup_core.default_plugins.sft.encode_example`)
    gives them; an :class:`EncodingError` carries the position in ``rows`` of the row it is about (``.row``)."""
    encode_example = per_row

    fast = bool(getattr(tokenizer, "is_fast", False))
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        kind = _kind(row) if fast else "row"
        groups.setdefault(kind, []).append(i)
    results: list[Any] = [None] * len(rows)
    for kind, positions in groups.items():
        picked = [rows[i] for i in positions]
        if kind == "chat":
            if not getattr(tokenizer, "chat_template", None):
                positions, kind = positions[:1], "row"  # the per-row function says why, for the first row
            else:
                chats = [[dict(m) for m in row["messages"]] for row in picked]
                try:
                    encoded = _encode_chats(chats, tokenizer, train_on_responses_only,
                                            has_generation_markers(tokenizer))
                except EncodingError as exc:
                    raise exc.with_row(positions[exc.row or 0]) from None
        if kind == "pc":
            encoded = _encode_prompt_completion(picked, tokenizer, train_on_responses_only)
        elif kind == "text":
            encoded = _encode_texts(picked, tokenizer)
        elif kind == "row":
            encoded = []
            for i in positions:
                try:
                    encoded.append(encode_example(rows[i], tokenizer, max_length=max_length,
                                                  train_on_responses_only=train_on_responses_only))
                except EncodingError as exc:
                    raise exc.with_row(i) from None
        for i, (ids, labels) in zip(positions, encoded, strict=True):
            results[i] = (ids[:max_length], labels[:max_length])
    return results


def encode_in_chunks(
    rows: Iterable[Mapping[str, Any]],
    tokenizer: Any,
    *,
    max_length: int,
    train_on_responses_only: bool = True,
    chunk: int = CHUNK,
    done: Callable[[int], None] = lambda n: None,
    per_row: Callable[..., Any],
) -> Iterable[tuple[int, list[int], list[int]]]:
    """Yield ``(row_index, input_ids, labels)`` for every row, a chunk at a time; ``done(n)`` after each chunk
    with the rows encoded so far. ``per_row`` encodes a row the batched path cannot take."""
    source = iter(rows)
    start = 0
    while True:
        picked = list(islice(source, chunk))
        if not picked:
            return
        try:
            encoded = encode_chunk(picked, tokenizer, max_length=max_length,
                                   train_on_responses_only=train_on_responses_only, per_row=per_row)
        except EncodingError as exc:
            row = start + (exc.row or 0)
            error = EncodingError(f"training row {row}: {exc}").with_row(row)
            error.detail = str(exc)  # what is wrong, without the row: a caller that passed a slice renumbers it
            raise error from exc
        for offset, (ids, labels) in enumerate(encoded):
            yield start + offset, ids, labels
        start += len(picked)
        done(start)
