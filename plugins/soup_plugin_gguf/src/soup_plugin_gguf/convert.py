"""A transformers model folder (config.json, safetensors, tokenizer.json) written as one GGUF file, with the
``gguf`` package: its writer, its tensor-name map per architecture, its quantisers and its ``SpecialVocab``
(merges, special-token ids, chat template). Metadata follows llama.cpp's converter, key for key, for the
architectures named in :data:`ARCHITECTURES`; any other is refused by name.

The file is written tensor by tensor (one tensor in memory at a time) under a temporary name beside the
output and renamed into place when complete: a failure (a full disk included) leaves no half-written file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ExportError(ValueError):
    """What cannot be exported, and how to fix it."""


#: transformers class -> (GGUF architecture, whether llama.cpp stores q/k rows interleaved for its rotary kernel)
ARCHITECTURES = {"LlamaForCausalLM": ("llama", True), "Qwen2ForCausalLM": ("qwen2", False)}
#: --type -> the GGML type of 2-D weights (1-D tensors, norms and biases, stay F32 as llama.cpp keeps them)
TYPES = ("f32", "f16", "bf16", "q8_0")
#: the tokenizer.json pre-tokenizer, as (type, detail) steps -> llama.cpp's name for it
_PRE_TOKENIZERS = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
}
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")


def ggml_type(name: str) -> Any:
    import gguf

    return gguf.GGMLQuantizationType[name.upper()]


def writable_types() -> list[str]:
    """The GGML types the installed ``gguf`` package quantises to (what ``--type same`` can keep)."""
    import gguf
    import numpy as np

    probe, found = np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 256), []
    for qtype in gguf.GGMLQuantizationType:
        try:
            gguf.quants.quantize(probe, qtype)
        except (NotImplementedError, ValueError, KeyError, TypeError, AssertionError):
            continue
        found.append(qtype.name)
    return found


@dataclass
class Plan:
    """What one tensor becomes: its GGUF name, the GGML type, and how to get its float32 values."""

    name: str
    source: str  # the safetensors key
    shape: tuple[int, ...]
    qtype: Any
    permute_heads: int = 0  # llama q/k: the head count to interleave the rows by (0: as stored)


def _pre_tokenizer(spec: Mapping[str, Any]) -> str | None:
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    key = []
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            key.append((kind, bool(step.get("use_regex", True))))
        elif kind == "Digits":
            key.append((kind, bool(step.get("individual_digits"))))
        elif kind == "Split":
            key.append((kind, (step.get("pattern") or {}).get("Regex")))
        else:
            key.append((kind, None))
    if tuple(key) == (("Split", _QWEN2_SPLIT), ("ByteLevel", False)):
        return "qwen2"
    return _PRE_TOKENIZERS.get(tuple(key))


def _byte_level_prefix(spec: Mapping[str, Any]) -> bool:
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return any(s.get("type") == "ByteLevel" and s.get("add_prefix_space") for s in steps)


def _config(folder: Path) -> tuple[dict[str, Any], str, bool]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{folder}: cannot read config.json ({exc}); give a model folder") from None
    classes = config.get("architectures") or [config.get("model_type", "?")]
    if classes[0] not in ARCHITECTURES:
        names = ", ".join(f"{arch} ({cls})" for cls, (arch, _) in ARCHITECTURES.items())
        raise ExportError(f"{folder}: architecture {classes[0]} is not one soup export --to gguf writes ({names}); "
                          "llama.cpp's own convert_hf_to_gguf.py covers more, on a merged folder (soup merge)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ExportError(f"{folder}: rope scaling {rope.get('rope_type', rope.get('type'))!r} is not written by "
                          "soup export --to gguf (only the default rotary embedding)")
    arch, permute = ARCHITECTURES[classes[0]]
    return config, arch, permute


def _tokenizer(folder: Path, vocab_size: int, pre: str | None) -> dict[str, Any]:
    """The tokenizer's GGUF metadata: tokens (by id), their types, the pre-tokenizer name, add_bos."""
    import gguf
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{folder} has no tokenizer.json; the GGUF needs the tokenizer (save it with the model)")
    spec = json.loads(path.read_text(encoding="utf-8"))
    if (spec.get("model") or {}).get("type") != "BPE":
        raise ExportError(f"{path}: a {(spec.get('model') or {}).get('type')} tokenizer; soup export --to gguf "
                          "writes byte-level BPE (gpt2-style) tokenizers only")
    pre = pre or _pre_tokenizer(spec)
    if pre is None:
        raise ExportError(f"{path}: its pre-tokenizer {json.dumps(spec.get('pre_tokenizer'))[:120]} is not one "
                          "llama.cpp is known to name the same way (gpt-2, smollm, qwen2); train from a GGUF base "
                          "(its pre-tokenizer is kept), or convert with llama.cpp's convert_hf_to_gguf.py")
    tokenizer = Tokenizer.from_file(str(path))
    added = {t["id"]: bool(t.get("special")) for t in spec.get("added_tokens", [])}
    tokens, types = [], []
    for index in range(vocab_size):
        text = tokenizer.id_to_token(index)
        if text is None:  # the embedding has rows past the vocabulary: llama.cpp names them so
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(text)
            types.append(gguf.TokenType.NORMAL if index not in added else
                         gguf.TokenType.CONTROL if added[index] else gguf.TokenType.USER_DEFINED)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    probe = tokenizer.encode("a", add_special_tokens=True).ids
    bos = special.special_token_ids.get("bos")
    special.add_special_token["bos"] = bool(probe) and bos is not None and probe[0] == bos
    return {"tokens": tokens, "types": types, "pre": pre, "special": special,
            "space_prefix": _byte_level_prefix(spec)}


def _safetensors(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{folder} holds no *.safetensors weights; give a model folder that transformers "
                          "saved (soup merge writes one)")
    return files


def plan(folder: Path, config: dict[str, Any], arch_name: str, permute: bool,
         choose: Callable[[str, tuple[int, ...]], Any]) -> list[Plan]:
    """Every tensor's GGUF name (the gguf package's map for the architecture), shape and type."""
    import gguf
    from safetensors import safe_open

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    plans = []
    for file in _safetensors(folder):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - a safetensors handle is not a mapping
                name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ExportError(f"{file}: tensor {key} has no GGUF name for {arch_name}; is the folder a "
                                      f"plain {arch_name} model (a merged one, not an adapter)?")
                shape = tuple(handle.get_slice(key).get_shape())
                heads_of = (heads if ".attn_q." in name else kv_heads if ".attn_k." in name else 0) if permute else 0
                plans.append(Plan(name, key, shape, choose(name, shape), heads_of))
    return plans


def _values(folder: Path, item: Plan) -> Any:
    import numpy as np
    from safetensors import safe_open

    for file in _safetensors(folder):
        with safe_open(str(file), framework="pt") as handle:
            if item.source in handle.keys():  # noqa: SIM118
                value = handle.get_tensor(item.source).float().numpy()
                break
    if item.permute_heads:  # llama.cpp's rotary kernel wants each head's rows as (pairs, halves) interleaved
        h = item.permute_heads
        value = value.reshape(h, 2, value.shape[0] // h // 2, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)
    return np.ascontiguousarray(value, dtype=np.float32)


def type_chooser(kind: str, same: Mapping[str, str] | None = None) -> Callable[[str, tuple[int, ...]], Any]:
    """The GGML type of each tensor for ``--type kind``; ``same``: the GGUF base's tensor name -> type name."""
    import gguf

    def choose(name: str, shape: tuple[int, ...]) -> Any:
        if len(shape) < 2:
            return gguf.GGMLQuantizationType.F32
        wanted = ggml_type(same.get(name, "F32") if same is not None else kind)
        block = gguf.GGML_QUANT_SIZES[wanted][0]
        if shape[-1] % block:  # a row that is not whole blocks: llama.cpp falls back to F16 as well
            return gguf.GGMLQuantizationType.F16
        return wanted

    return choose


def write_gguf(folder: Path, out: Path, kind: str, *, pre: str | None = None, name: str = "",
               same: Mapping[str, str] | None = None,
               progress: Callable[[int, int, str], Any] | None = None) -> Path:
    """Write the model in ``folder`` to ``out`` (renamed into place when complete). ``kind``: one of
    :data:`TYPES`, or ``same`` with ``same`` the base's tensor types. ``pre``: the pre-tokenizer name to
    write (the GGUF base's; None: told from tokenizer.json)."""
    import gguf
    import numpy as np

    config, arch, permute = _config(folder)
    vocab_size = int(config["vocab_size"])
    tok = _tokenizer(folder, vocab_size, pre)
    plans = plan(folder, config, arch, permute, type_chooser(kind, same))
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(handle)
    tmp = Path(tmp_name)
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        rope = config.get("rope_parameters") or {}
        writer.add_type("model")
        if name:
            writer.add_name(name)
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(config["hidden_size"])
        writer.add_block_count(config["num_hidden_layers"])
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(heads)
        writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
        writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        counts: dict[Any, int] = {}
        for item in plans:
            if len(item.shape) > 1:
                counts[item.qtype] = counts.get(item.qtype, 0) + 1
        main = max(counts, key=lambda t: counts[t]) if counts else gguf.GGMLQuantizationType.F32
        writer.add_file_type(getattr(gguf.LlamaFileType, "ALL_F32" if main.name == "F32" else f"MOSTLY_{main.name}"))
        writer.add_vocab_size(vocab_size)
        writer.add_rope_dimension_count(head_dim)
        if head_dim != config["hidden_size"] // heads:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        writer.add_add_space_prefix(tok["space_prefix"])
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(tok["pre"])
        writer.add_token_list(tok["tokens"])
        writer.add_token_types(tok["types"])
        tok["special"].add_to_gguf(writer, quiet=True)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for item in plans:
            float_type = item.qtype.name in ("F32", "F16")
            byte_shape = item.shape if float_type else gguf.quant_shape_to_byte_shape(item.shape, item.qtype)
            dtype = np.dtype({"F32": np.float32, "F16": np.float16}.get(item.qtype.name, np.uint8))
            writer.add_tensor_info(item.name, byte_shape, dtype, int(np.prod(byte_shape)) * dtype.itemsize,
                                   raw_dtype=None if float_type else item.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, item in enumerate(plans):
            writer.write_tensor_data(gguf.quants.quantize(_values(folder, item), item.qtype))
            if progress is not None:
                progress(i + 1, len(plans), item.name)
        writer.close()
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    finally:
        writer.close()
        if tmp.exists():
            tmp.unlink()
    return out


def _umask() -> int:
    from soup_core.io import umask

    return umask()
