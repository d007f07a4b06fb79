"""The batched encoding (a chunk of rows through the chat template and one tokenizer call) gives, row for row,
exactly the tokens and labels of the per-row definition ``encode_example``, on every format and template kind."""

from __future__ import annotations

import copy

import pytest

from soup_core.default_plugins.formats import BUILTIN_FORMATS


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def unigram():
    """A second kind of tokenizer: a Unigram model with a Metaspace pre-tokenizer and an NFKC normaliser (offsets
    that map back through a normaliser), a template without generation markers and no bos token."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    corpus = [" ".join(r["text"] for r in RAW["text"])] * 3 + ["the quick brown fox jumps over the lazy dog"] * 5
    tok.train_from_iterator(corpus, trainers.UnigramTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"],
                                                            unk_token="<unk>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="</s>")
    fast.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n\n{% endfor %}"
                          "{% if add_generation_prompt %}[assistant] {% endif %}")
    return fast


WORDS = ["hello", "  spaced  out ", "naïve café", "東京の天気", "emoji 🎉🧪 ok", "tab\there", "new\nline",
         "<|end|> inside", "<|assistant|>", "x" * 300, "", " ", "ﬁ ligature ①"]


def _ne(i: int, fill: str) -> str:
    """WORDS[i] where a format needs a non-empty string, else ``fill``."""
    word = WORDS[i % len(WORDS)]
    return word if word.strip() else fill


RAW = {
    "chat": [
        {"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": _ne(i + 3, "a")}]}
        for i, w in enumerate(WORDS)
    ] + [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1 🎉"},
                      {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                      {"role": "assistant", "content": " a2 with 東京 "}]},
        {"messages": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"},
                      {"role": "assistant", "content": "y" * 400}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                      {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]},
    ],
    "alpaca": [{"instruction": _ne(i, "do"), "input": WORDS[(i + 1) % 13], "output": _ne(i + 5, "z")}
               for i, w in enumerate(WORDS)],
    "prompt_completion": [{"prompt": w, "completion": _ne(i + 2, "c")} for i, w in enumerate(WORDS)],
    "text": [{"text": _ne(i, "t")} for i in range(len(WORDS))],
}
FORMATS = {f.name: f for f in BUILTIN_FORMATS}
ROWS = {name: [FORMATS[name].to_example(r) for r in raw] for name, raw in RAW.items()}


def _per_row(rows, tok, **kw):
    from soup_core.default_plugins.sft import encode_example

    return [encode_example(r, tok, **kw) for r in rows]


def _batched(rows, tok, **kw):
    from soup_core.default_plugins.sft import encode_rows

    return [(e["input_ids"], e["labels"]) for e in encode_rows(rows, tok, **kw)]


def _plain(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    return plain


@pytest.mark.parametrize("fmt", sorted(RAW))
@pytest.mark.parametrize("responses_only", [True, False])
@pytest.mark.parametrize("max_length", [512, 9])
def test_batched_encoding_equals_the_per_row_definition(tokenizer, unigram, fmt, responses_only, max_length):
    rows = ROWS[fmt]
    kw = dict(max_length=max_length, train_on_responses_only=responses_only)
    for tok in (tokenizer, _plain(tokenizer), unigram):  # generation markers, prefix rendering, another tokenizer
        expected = _per_row(rows, tok, **kw)
        assert _batched(rows, tok, **kw) == expected
        if responses_only and fmt != "text" and max_length > 9:
            assert any(labels != ids for ids, labels in expected)  # the masks are not trivial


def test_mixed_formats_in_small_chunks_keep_row_order(tokenizer, monkeypatch):
    from soup_core.default_plugins import sft_batch
    from soup_core.default_plugins.sft import encode_example

    rows = [row for group in zip(*(ROWS[f] for f in sorted(ROWS)), strict=False) for row in group]
    monkeypatch.setattr(sft_batch, "CHUNK", 5)
    got = [(i, ids, labels) for i, ids, labels in sft_batch.encode_in_chunks(rows, tokenizer, max_length=64, chunk=5,
                                                                            per_row=encode_example)]
    assert [i for i, _, _ in got] == list(range(len(rows)))
    assert [(ids, labels) for _, ids, labels in got] == _per_row(rows, tokenizer, max_length=64)


def test_control_a_mask_off_by_one_character_is_caught(tokenizer):
    """The comparison can fail: spans shifted by one character give other labels on these rows."""
    from soup_core.default_plugins.sft_batch import _render_with_spans, _span_labels

    chats = [r["messages"] for r in ROWS["chat"]]
    texts, spans = _render_with_spans(chats, tokenizer)
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    right = [_span_labels(ids, enc["offset_mapping"][i], spans[i]) for i, ids in enumerate(enc["input_ids"])]
    shifted = [_span_labels(ids, enc["offset_mapping"][i], [(s - 1, e - 1) for s, e in spans[i]])
               for i, ids in enumerate(enc["input_ids"])]
    expected = [labels for _, labels in _per_row(ROWS["chat"], tokenizer, max_length=10_000)]
    assert right == expected
    assert shifted != expected


def test_errors_name_the_training_row(tokenizer):
    from soup_core.default_plugins.sft import EncodingError, encode_rows

    rows = [ROWS["text"][0], ROWS["text"][1], {"odd": "row"}]
    with pytest.raises(EncodingError, match=r"training row 2: .*keys odd"):
        encode_rows(rows, tokenizer, max_length=32)
    nochat = copy.deepcopy(tokenizer)
    nochat.chat_template = None
    with pytest.raises(EncodingError, match=r"training row 1: the tokenizer has no chat template"):
        encode_rows([ROWS["text"][0], ROWS["chat"][0]], nochat, max_length=32)
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(EncodingError, match=r"training row 1: .*generation"):
        encode_rows([ROWS["text"][0], ROWS["chat"][0]], odd, max_length=32)
