"""How the sft task turns normalised rows into input ids and labels (which tokens are trained)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _trained_text(tokenizer, ids, labels):
    return tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != -100])


CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "second answer"},
    ]
}


def test_chat_trains_on_assistant_turns_only(tokenizer):
    from soup_core.default_plugins.sft import encode_example

    ids, labels = encode_example(CHAT, tokenizer, max_length=256)
    assert _trained_text(tokenizer, ids, labels) == "first answer<|end|>second answer<|end|>"
    full_ids, full_labels = encode_example(CHAT, tokenizer, max_length=256, train_on_responses_only=False)
    assert full_ids == ids and full_labels == full_ids  # control: without the switch every token trains


def test_chat_mask_without_generation_markers_matches_the_marked_template(tokenizer):
    """Templates without {% generation %} are masked by rendering prefixes; same result here."""
    import copy

    from soup_core.default_plugins.sft import encode_example, has_generation_markers

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert has_generation_markers(tokenizer) and not has_generation_markers(plain)
    assert encode_example(CHAT, plain, max_length=256) == encode_example(CHAT, tokenizer, max_length=256)


def test_chat_prefix_mask_refuses_a_template_that_rewrites_history(tokenizer):
    import copy

    from soup_core.default_plugins.sft import EncodingError, encode_example

    odd = copy.deepcopy(tokenizer)
    # renders the number of messages first, so a prefix of the conversation is not a prefix of its text
    odd.chat_template = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(EncodingError, match="generation"):
        encode_example(CHAT, odd, max_length=256)


def test_prompt_completion_trains_on_the_completion_and_eos(tokenizer):
    from soup_core.default_plugins.sft import encode_example

    row = {"prompt": "Translate: cat ->", "completion": " chat"}
    ids, labels = encode_example(row, tokenizer, max_length=256)
    assert _trained_text(tokenizer, ids, labels) == " chat<|end|>"
    assert tokenizer.decode(ids) == "Translate: cat -> chat<|end|>"
    _, all_labels = encode_example(row, tokenizer, max_length=256, train_on_responses_only=False)
    assert all_labels == ids


def test_text_trains_on_everything_and_ends_with_eos(tokenizer):
    from soup_core.default_plugins.sft import encode_example

    ids, labels = encode_example({"text": "def f(x): return x"}, tokenizer, max_length=256)
    assert labels == ids and ids[-1] == tokenizer.eos_token_id


def test_truncation_keeps_rows_even_without_trained_tokens(tokenizer):
    from soup_core.default_plugins.sft import encode_rows

    long_prompt = {"prompt": "word " * 200, "completion": "answer"}
    rows = encode_rows([{"text": "short"}, long_prompt], tokenizer, max_length=16)
    assert [r["row_index"] for r in rows] == [0, 1]
    assert all(len(r["input_ids"]) <= 16 and len(r["labels"]) == len(r["input_ids"]) for r in rows)
    assert len(rows[1]["input_ids"]) == 16 and set(rows[1]["labels"]) == {-100}


def test_unknown_example_shape_is_refused_with_its_row(tokenizer):
    from soup_core.default_plugins.sft import EncodingError, encode_rows

    with pytest.raises(EncodingError, match="training row 1: .*keys chosen, prompt"):
        encode_rows([{"text": "ok"}, {"prompt": "p", "chosen": "c"}], tokenizer, max_length=16)


def test_chat_rows_need_a_chat_template(tokenizer):
    import copy

    from soup_core.default_plugins.sft import EncodingError, encode_example

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(EncodingError, match="no chat template"):
        encode_example(CHAT, bare, max_length=64)


def test_sft_task_declares_its_contract():
    from soup_core.default_plugins import sft as task_plugin
    from soup_core.default_plugins.sft import SFTTask

    assert task_plugin.soup_register_tasks() == [SFTTask]
    assert task_plugin.SOUP_HOOK_API == (1, 1)
    assert SFTTask.name == "sft" and SFTTask.data_keys == ("data.train",)
    assert set(SFTTask.formats) == {"chat", "alpaca", "prompt_completion", "text"}
    assert {"per_row_losses", "streamable"} <= SFTTask.capabilities
