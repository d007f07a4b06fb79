"""Tiny language models built locally, for tests, benchmarks and ``soup quickstart``.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on the Python standard library's own
source files (always on disk), and the model is a randomly initialised Llama built from a config. The
result is an ordinary Hugging Face folder that ``AutoTokenizer`` / ``AutoModelForCausalLM`` load.

Heavy imports (torch, transformers, tokenizers) happen inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from soup_core.default_plugins.transformers.loading import quiet_progress
from soup_core.tracker.store import soup_home

#: Bump when anything below changes what gets built, so cached folders are rebuilt.
BUILDER_VERSION = 2

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)

# The assistant's content and its end-of-turn token sit inside {% generation %} so that
# ``return_assistant_tokens_mask`` (and trl's assistant-only loss) can find the tokens to train on.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    # (an explicit newline expression: jinja's trim_blocks would eat a literal newline after the tag)
    "<|assistant|>\n{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_TRAIN_FILES = 40  # the first N stdlib modules by name: ~1 MB of text, ~0.3 s to train on


def _stdlib_sources() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:_TRAIN_FILES]
    if not files:  # pragma: no cover - every CPython install ships its .py sources
        raise RuntimeError(f"no Python source files found under {stdlib} to train the tiny tokenizer on")
    return files


def build_tiny_tokenizer(path: str | os.PathLike[str] | None = None, *, vocab_size: int = 1000):
    """Train a byte-level BPE (``vocab_size`` tokens) and return it as a ``PreTrainedTokenizerFast``.

    It has pad/bos/eos tokens, role tokens and a chat template with ``{% generation %}`` markers. When
    ``path`` is given the tokenizer is also saved there.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for file in _stdlib_sources():
            yield file.read_text(encoding="utf-8", errors="replace")

    tok.train_from_iterator(texts(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="right",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    if path is not None:
        fast.save_pretrained(str(path))
    return fast


def build_tiny_model(
    path: str | os.PathLike[str],
    *,
    hidden: int = 64,
    layers: int = 2,
    arch: str = "llama",
    seed: int = 0,
    tokenizer=None,
) -> Path:
    """Build a randomly initialised causal LM and save it, with its tokenizer, to ``path``.

    ``arch`` is ``llama`` (the default) or ``qwen2``/``mistral`` (same shapes, other class names).
    Deterministic for a given ``seed``.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    if arch not in configs:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(configs)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    heads = max(1, hidden // 16)
    config = configs[arch](
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    # Seed a private generator state so that building a model does not disturb the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with quiet_progress():  # "Writing model shards" bars would clutter test and quickstart logs
        model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def _cache_key(hidden: int, layers: int, arch: str, seed: int) -> str:
    import tokenizers
    import transformers

    facts = {
        "builder": BUILDER_VERSION,
        "hidden": hidden,
        "layers": layers,
        "arch": arch,
        "seed": seed,
        "python": sys.version_info[:2],
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
    }
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]
    return f"{arch}-h{hidden}-l{layers}-s{seed}-{digest}"


def tiny_model_dir(
    cache_root: str | os.PathLike[str] | None = None,
    *,
    hidden: int = 64,
    layers: int = 2,
    arch: str = "llama",
    seed: int = 0,
) -> Path:
    """Return the folder of a tiny model, building it once and caching it under ``cache_root``
    (default ``$SOUP_HOME/tiny``, else ``~/.soup/tiny``).

    Safe when several processes race: each builds in a private temp folder and renames it into place;
    the first rename wins and the others discard their copy.
    """
    root = Path(cache_root) if cache_root is not None else soup_home() / "tiny"
    target = root / _cache_key(hidden, layers, arch, seed)
    marker = target / "soup-tiny.json"
    if marker.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        build_tiny_model(tmp, hidden=hidden, layers=layers, arch=arch, seed=seed)
        # Written last: a folder with the marker is complete.
        (tmp / "soup-tiny.json").write_text(
            json.dumps({"builder": BUILDER_VERSION, "hidden": hidden, "layers": layers, "arch": arch, "seed": seed})
        )
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process renamed its copy first (the target is a non-empty folder): use that one.
            if not marker.is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _permute(weights, heads: int):
    # llama.cpp stores q/k rows interleaved for its rotary kernel; transformers' GGUF loader undoes this
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def build_tiny_gguf(
    model_dir: str | os.PathLike[str], path: str | os.PathLike[str], *, quant: str = "F32",
    norm_type: str | None = None,
) -> Path:
    """Write the tiny Llama in ``model_dir`` (see :func:`tiny_model_dir`) as a GGUF file at ``path``, as
    llama.cpp's converter would: llama architecture, its tokenizer as a gpt2-style BPE and its chat template
    in the metadata. ``quant``: ``F32``, ``F16`` or ``Q8_0`` for the 2-D weights; ``norm_type`` stores the
    norm weights in another numpy type (``F64``: one transformers cannot load, for tests of the refusal)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    model_dir, out = Path(model_dir), Path(path)
    config = AutoConfig.from_pretrained(str(model_dir))
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    weights = load_file(str(model_dir / "model.safetensors"))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("soup tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_vocab_size(config.vocab_size)
    vocab = spec["model"]["vocab"]
    added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    tokens = [""] * config.vocab_size
    for text, index in {**vocab, **added}.items():
        tokens[index] = text
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in added.values() else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    for name, setter in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                         ("pad", writer.add_pad_token_id)):
        setter(added[tok_config[f"{name}_token"]])
    writer.add_chat_template(tok_config.get("chat_template") or CHAT_TEMPLATE)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, value in weights.items():
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "lm_head.weight":
            name = "output.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        else:
            _, _, layer, module = key.split(".", 3)
            name = f"blk.{layer}.{names[module.rsplit('.', 1)[0]]}.weight"
        value = value.astype(np.float32)
        if name.endswith("attn_q.weight"):
            value = _permute(value, heads)
        elif name.endswith("attn_k.weight"):
            value = _permute(value, kv_heads)
        if value.ndim == 1:
            kind = norm_type or "F32"
            writer.add_tensor(name, value.astype(np.float64) if kind == "F64" else value)
        elif quant == "Q8_0":
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(value, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, value.astype(np.float16) if quant == "F16" else value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
