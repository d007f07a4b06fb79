"""Loading a model and tokenizer for the transformers backend, adding the LoRA adapter, merging it.

Heavy imports happen inside the functions: the backend's plugin module must stay light.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from soup_core.contracts import LoadedModel
from soup_core.default_plugins.transformers.errors import BackendError

_DTYPES = ("float32", "bfloat16", "float16")

#: LoRA targets for ``target_modules: auto`` by architecture family, when the model has them. Any other
#: architecture gets every linear layer inside its decoder blocks.
_AUTO_TARGETS = {
    "llama-like": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def resolve_dtype(name: str) -> Any:
    """The torch dtype for ``training.dtype``. ``auto``: bf16 where the hardware has it natively, fp16
    on other CUDA devices, fp32 on CPU."""
    import torch

    if name == "auto":
        if torch.cuda.is_available():
            if torch.cuda.is_bf16_supported(including_emulation=False):
                return torch.bfloat16
            return torch.float16
        return torch.float32
    if name not in _DTYPES:
        raise BackendError(f"training.dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return getattr(torch, name)


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Silence transformers' loading/saving progress bars (they spam logs when stdout is not a TTY)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _looks_local(base: str) -> bool:
    # A hub id is "name" or "org/name"; anything else that names a path is meant as a folder.
    return base.startswith((".", "/", "~")) or "\\" in base or base.count("/") > 1


def quantization_config(config: Any, compute_dtype: Any) -> Any:
    """The ``BitsAndBytesConfig`` for ``training.quantization`` (None for ``none``)."""
    quant = config.training.quantization
    if quant in (None, "none"):
        return None
    from transformers import BitsAndBytesConfig

    if quant == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=bool(config.training.bnb_4bit_use_double_quant),
            bnb_4bit_compute_dtype=compute_dtype,
        )
    if quant == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise BackendError(f"training.quantization must be none, 4bit or 8bit; got {quant!r}")


def load_dtype(config: Any) -> Any:
    """The dtype the weights are loaded in. Full fine-tuning under fp16 loads fp32 weights and trains with
    fp16 autocast: fp16 master weights cannot be unscaled by the gradient scaler."""
    import torch

    dtype = resolve_dtype(config.training.dtype)
    if int(config.training.lora.r) == 0 and dtype == torch.float16:
        return torch.float32
    return dtype


def load_model_and_tokenizer(config: Any) -> LoadedModel:
    """Load ``config.base`` (a local folder or a hub id) with the config's dtype and quantization.

    The tokenizer gets a pad token (its eos) when it has none. No adapter is added here.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.transformers.gguf import resolve_base, source_record

    base = str(config.base)
    expanded = os.path.expanduser(base)
    if _looks_local(base) and not Path(expanded).exists():
        raise BackendError(f"base: model folder {base!r} does not exist; give a folder or a hub model id")
    compute_dtype = resolve_dtype(config.training.dtype)
    if compute_dtype == torch.float16 and not torch.cuda.is_available():
        raise BackendError("training.dtype float16 needs a CUDA GPU; use bfloat16 or float32 (or auto) on CPU")
    quant = quantization_config(config, compute_dtype)
    if quant is not None and int(config.training.lora.r) == 0:
        raise BackendError(
            "training.quantization needs a LoRA adapter: a quantized base cannot be fully fine-tuned; "
            "set training.lora.r above 0 or training.quantization: none"
        )
    kwargs: dict[str, Any] = {"dtype": load_dtype(config)}
    expanded = resolve_base(expanded, kwargs["dtype"])  # a GGUF base: its dequantised folder, in that dtype
    if quant is not None:
        kwargs["quantization_config"] = quant
        if torch.cuda.is_available():
            kwargs["device_map"] = {"": torch.cuda.current_device()}
    try:
        with quiet_progress():
            tokenizer = AutoTokenizer.from_pretrained(expanded)
            model = AutoModelForCausalLM.from_pretrained(expanded, **kwargs)
    except OSError as exc:
        raise BackendError(
            f"base: cannot load model {base!r}: {exc}. Check the folder or hub id (and that you are online "
            "for a hub id that is not cached)"
        ) from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    extra: dict[str, Any] = {"dtype": str(kwargs["dtype"])}
    if (record := source_record(base)) is not None:
        extra["base_gguf"] = record
        # what an adapter records as its base (soup merge's default): the file, not the cache folder it was
        # loaded from, which `soup cache clear` removes
        model.name_or_path = model.config._name_or_path = record["path"]
    return LoadedModel(model=model, tokenizer=tokenizer, loaded_by="transformers", extra=extra)


def _linear_types() -> tuple[type, ...]:
    import torch
    from transformers.pytorch_utils import Conv1D

    types: list[type] = [torch.nn.Linear, Conv1D]
    try:  # quantized linears are not subclasses of nn.Linear in every bitsandbytes release
        import bitsandbytes as bnb

        types += [bnb.nn.Linear4bit, bnb.nn.Linear8bitLt]
    except Exception:  # noqa: BLE001 - bitsandbytes is optional
        pass
    return tuple(types)


def resolve_target_modules(model: Any, target_modules: Any) -> list[str]:
    """The module names LoRA attaches to. ``auto``: the attention and MLP projections of llama-like
    models (q/k/v/o/gate/up/down), else every linear layer except the output head."""
    if target_modules != "auto":
        names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [n for n in names if n not in present and not any(k.endswith(n) for k, _ in model.named_modules())]
        if missing:
            raise BackendError(
                f"training.lora.target_modules: {', '.join(missing)} not found in the model; "
                "use auto, or names of its linear layers"
            )
        return names
    linear = _linear_types()
    output = model.get_output_embeddings()
    found: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, linear) and module is not output:
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in found:
                found.append(leaf)
    llama_like = _AUTO_TARGETS["llama-like"]
    if all(name in found for name in llama_like):
        return list(llama_like)
    if not found:
        raise BackendError("training.lora.target_modules: auto found no linear layer in this model; name them")
    return found


def _lean_layers(model: Any, config: Any) -> None:
    # the MLPs keep their gate and up projections for the backward pass, not the activation and the product
    # (exact; lean_layers.py); checkpointed layers keep nothing anyway
    if not config.training.gradient_checkpointing:
        from soup_core.default_plugins.transformers.lean_layers import install

        install(model)


def install_lean_lora(model: Any) -> int:
    """Give each plain peft LoRA layer of ``model`` Soup's dropout forward (``lean_lora.py``): the mask drawn gap by
    gap (the same Bernoulli law as ``torch.dropout``) and kept as the dropped positions for the backward pass.
    ``apply_lora`` calls it whenever ``lora.dropout > 0``, with gradient checkpointing or without (the recompute
    restores the random state and draws the same masks); a plugin that builds its own peft model calls it so that
    its runs draw the masks a resident Soup run draws. Returns how many layers got it."""
    from soup_core.default_plugins.transformers.lean_lora import install

    return install(model)


def apply_lora(model: Any, config: Any, *, report: Any = print) -> Any:
    """Add a LoRA adapter as the config asks (``lora.r: 0``: none, every weight trains). Returns the model."""
    lora = config.training.lora
    r = int(lora.r)
    quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    if r == 0:
        for param in model.parameters():
            param.requires_grad_(True)
        _lean_layers(model, config)
        report("LoRA off (training.lora.r: 0): full fine-tuning")
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if quantized:
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=bool(config.training.gradient_checkpointing)
        )
    targets = resolve_target_modules(model, lora.target_modules)
    peft_config = LoraConfig(
        r=r,
        lora_alpha=lora.alpha,
        lora_dropout=float(lora.dropout),
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, peft_config)
    if float(lora.dropout) > 0:
        install_lean_lora(model)
    _lean_layers(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    report(
        f"LoRA r={r} alpha={lora.alpha} on {', '.join(targets)}: "
        f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"
    )
    return model


def merge_adapter(
    base: str | os.PathLike[str], adapter_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]
) -> Path:
    """Merge the LoRA adapter in ``adapter_dir`` into ``base`` and write a plain HF model folder.

    The base is loaded in fp32 so the merge adds no rounding; the tokenizer saved beside the adapter (else
    the base's) is written too. The folder is built beside ``out_dir`` and renamed into place.
    """
    import shutil
    import tempfile

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = Path(adapter_dir)
    if not (adapter / "adapter_config.json").is_file():
        raise BackendError(f"{adapter} holds no PEFT adapter (adapter_config.json is missing)")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise BackendError(f"{out} exists and is not empty; choose another output folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    from soup_core.default_plugins.transformers.gguf import resolve_base

    folder = resolve_base(str(base), torch.float32)  # a GGUF base: its dequantised folder, in fp32
    with quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        source = adapter if (adapter / "tokenizer_config.json").is_file() else Path(folder)
        tokenizer = AutoTokenizer.from_pretrained(str(source))
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            merged.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
            from soup_core import __version__
            from soup_core.model_card import CARD, merged_card, write_card

            card = adapter / CARD
            write_card(tmp, merged_card(card.read_text(encoding="utf-8") if card.is_file() else None,
                                        base=str(base), adapter=adapter, version=__version__))
            # mkdtemp makes the folder 0700; the merged model is an output like any other
            from soup_core.io import umask

            os.chmod(tmp, 0o777 & ~umask())
            if out.exists():
                out.rmdir()
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out
