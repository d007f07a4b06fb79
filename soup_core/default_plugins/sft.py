"""The default plugin ``core.sft``: the ``sft`` task, supervised fine-tuning on chat, prompt/completion and
text rows, registered through the same hook any plugin uses.

Tokenisation lives here (it is the task's business what a row trains on); the trainer that runs it is the
backend's. Every encoded example keeps its row index, so per-row statistics can be attributed to rows.
Import-light: the tokenizer is passed in, nothing heavy is imported at module level.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from soup_core.contracts import Backend, Task
from soup_core.default_plugins.sft_batch import PREFIX_ERROR, EncodingError, encode_in_chunks, has_generation_markers
from soup_core.hookspecs import hookimpl

SOUP_HOOK_API = (1, 1)
__all__ = ["EncodingError", "SFTTask", "encode_example", "encode_rows", "has_generation_markers"]

IGNORE = -100  # the label value transformers' losses skip

def _ids(encoding: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); older ones a list.
    ids = encoding["input_ids"] if isinstance(encoding, Mapping) or hasattr(encoding, "keys") else encoding
    return list(ids)


def _encode_chat(messages: Sequence[Mapping[str, str]], tokenizer: Any, responses_only: bool):
    if not getattr(tokenizer, "chat_template", None):
        raise EncodingError(
            "the tokenizer has no chat template, so chat rows cannot be rendered; set data.chat_template (chatml, "
            "llama3, zephyr, simple, or Jinja text), use a model with a chat template, or give the data as "
            "prompt/completion or text rows"
        )
    messages = [dict(m) for m in messages]
    if not responses_only:
        ids = _ids(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True))
        return ids, list(ids)
    if has_generation_markers(tokenizer):
        enc = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = _ids(enc)
        mask = list(enc["assistant_masks"])
        return ids, [tok if keep else IGNORE for tok, keep in zip(ids, mask, strict=True)]
    return _encode_chat_by_prefix(messages, tokenizer)


def _encode_chat_by_prefix(messages: list[dict[str, str]], tokenizer: Any):
    """Mask by rendering prefixes, for chat templates without ``{% generation %}`` markers.

    The assistant turn ``i`` spans the characters between the rendering of ``messages[:i]`` with a
    generation prompt and the rendering of ``messages[:i+1]`` (less trailing whitespace); tokens overlapping
    such a span are trained.
    This needs the template to render every prefix as a prefix of the whole conversation.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise EncodingError(PREFIX_ERROR)
        # Whitespace the template puts after a turn separates turns; it is not the answer.
        spans.append((len(before), len(upto.rstrip())))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [
        tok if any(start < end_span and end > start_span for start_span, end_span in spans) else IGNORE
        for tok, (start, end) in zip(ids, enc["offset_mapping"], strict=True)
    ]
    return ids, labels


def encode_example(
    example: Mapping[str, Any], tokenizer: Any, *, max_length: int, train_on_responses_only: bool = True
) -> tuple[list[int], list[int]]:
    """Tokenise one normalised example into ``(input_ids, labels)``; labels are ``-100`` where not trained.

    - chat (``messages``): the tokenizer's chat template; with ``train_on_responses_only`` only the
      assistant turns are trained.
    - prompt/completion: prompt tokens, then completion tokens and eos; with ``train_on_responses_only``
      only the completion (and eos) is trained.
    - text: the text and eos, all trained.

    Truncated to ``max_length`` tokens from the start. A row may end up with no trained token (all of it
    truncated away): it is kept, so row indices never shift; its loss is then NaN with 0 tokens.
    """
    eos = tokenizer.eos_token_id
    if "messages" in example:
        ids, labels = _encode_chat(example["messages"], tokenizer, train_on_responses_only)
    elif "prompt" in example and "completion" in example:
        prompt = list(tokenizer(example["prompt"], add_special_tokens=True)["input_ids"]) if example["prompt"] else []
        completion = list(tokenizer(example["completion"], add_special_tokens=False)["input_ids"])
        if not prompt and tokenizer.bos_token_id is not None:
            prompt = [tokenizer.bos_token_id]
        if eos is not None and (not completion or completion[-1] != eos):
            completion.append(eos)
        ids = prompt + completion
        labels = ([IGNORE] * len(prompt) if train_on_responses_only else list(prompt)) + completion
    elif "text" in example:
        ids = list(tokenizer(example["text"], add_special_tokens=True)["input_ids"])
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        labels = list(ids)
    else:
        keys = ", ".join(sorted(example)) or "none"
        raise EncodingError(f"the sft task cannot train on an example with keys {keys}")
    return ids[:max_length], labels[:max_length]


def encode_rows(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    max_length: int,
    train_on_responses_only: bool = True,
) -> list[dict[str, Any]]:
    """Encode every row; each result carries ``input_ids``, ``labels`` and ``row_index`` (its position).

    The same tokens as :func:`encode_example` row by row, found a chunk of rows at a time with the fast
    tokenizer's batched call (:mod:`soup_core.default_plugins.sft_batch`).
    """
    return [
        {"input_ids": ids, "labels": labels, "row_index": index}
        for index, ids, labels in encode_in_chunks(
            rows, tokenizer, max_length=max_length, train_on_responses_only=train_on_responses_only,
            per_row=encode_example,
        )
    ]


class SFTTask(Task):
    """Supervised fine-tuning: next-token loss on the trained tokens of each row."""

    name = "sft"
    description = "supervised fine-tuning on chat, alpaca, prompt/completion or text rows"
    data_keys = ("data.train",)
    formats = ("chat", "alpaca", "prompt_completion", "text")
    capabilities = frozenset({"per_row_losses", "streamable", "token_cross_entropy", "shardable"})
    #: Bump when encode would give other tokens for the same rows: prepared data in the cache is keyed by it.
    encoding_version = 1

    def encode(self, rows: Sequence[Mapping[str, Any]], tokenizer: Any, config: Any) -> list[dict[str, Any]]:
        """Encode rows with the config's ``data.max_length`` and ``data.train_on_responses_only``; each of the
        task's ``extra_keys`` goes beside the tokens (the row's value, else the declared default), where the
        trainer's default collator brings it into the batch."""
        encoded = encode_rows(
            rows,
            tokenizer,
            max_length=int(config.data.max_length),
            train_on_responses_only=bool(config.data.train_on_responses_only),
        )
        extra = dict(self.extra_keys)
        for item in encoded if extra else ():
            row = rows[item["row_index"]]
            item.update((key, row.get(key, default)) for key, default in extra.items())
        return encoded

    def build(self, backend: Backend, context: Any) -> Any:
        """Build the trainer for ``backend``; ``context`` is the backend's trainer setup."""
        if backend.name != "transformers":
            raise NotImplementedError(f"the sft task has no trainer for backend {backend.name!r}")
        from soup_core.default_plugins.transformers.trainer import SoupSFTTrainer, datasets_for

        train_dataset, eval_dataset = datasets_for(self, context)
        return SoupSFTTrainer.from_setup(context, train_dataset, eval_dataset)


@hookimpl
def soup_register_tasks() -> list[type]:
    return [SFTTask]
