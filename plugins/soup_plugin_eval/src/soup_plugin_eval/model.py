"""Loading a target and generating from it: transformers (with peft for an adapter), or mlx-lm for an mlx run.

Imported by the commands when they run: torch, transformers and peft load here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from soup_plugin_eval.target import Target, TargetError


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    engine: str  # "transformers" or "mlx"


def _tokenizer_folder(target: Target) -> str:
    """The tokenizer the run saved (its chat template included): beside the weights, else the run's folder."""
    for folder in (target.weights, target.run_dir):
        if folder is not None and (folder / "tokenizer_config.json").is_file():
            return str(folder)
    from soup_core.default_plugins.transformers import resolve_base

    return resolve_base(target.base)  # a GGUF base: the tokenizer of its dequantised folder


def load(target: Target) -> Loaded:
    """Load the target's model and tokenizer for inference (eval mode, pad token set, left padding)."""
    if target.kind == "mlx":
        return _load_mlx(target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from soup_core.default_plugins.transformers import BackendError, resolve_dtype

    hf_logging.disable_progress_bar()  # a bar per load is noise in a command that prints results

    dtype = resolve_dtype(target.config.training.dtype)
    if dtype == torch.float16 and not torch.cuda.is_available():
        dtype = torch.float32  # fp16 kernels need a GPU; the run's fp16 weights load exactly in fp32
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        tokenizer = AutoTokenizer.from_pretrained(_tokenizer_folder(target))
        if target.kind == "adapter":
            from peft import PeftModel

            from soup_core.default_plugins.transformers import resolve_base

            # a GGUF base loads from its dequantised folder (built on first use)
            folder = resolve_base(str(Path(target.base).expanduser()), dtype)
            base = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
            model = PeftModel.from_pretrained(base, str(target.weights))
        else:
            model = AutoModelForCausalLM.from_pretrained(str(target.weights), dtype=dtype)
    except (OSError, ValueError, BackendError) as exc:
        where = f"base {target.base} with the adapter {target.weights}" if target.kind == "adapter" else target.weights
        raise TargetError(f"cannot load {where}: {exc}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.to(device).eval()
    return Loaded(model, tokenizer, "transformers")


def _load_mlx(target: Target) -> Loaded:
    """mlx-lm's model with the run's adapter, and the run's own tokenizer (its chat template), which
    mlx-lm's generation wraps as it wraps any Hugging Face tokenizer."""
    from soup_core import probes

    if not probes.distribution("mlx-lm").ok:
        raise TargetError(f"{target.weights} was trained by the mlx backend; generating from it needs mlx-lm "
                          "(pip install soup-plugin-mlx), or convert it: soup export ADAPTER --to peft -o OUT")
    from mlx_lm import load as mlx_load
    from transformers import AutoTokenizer

    try:
        if (target.weights / "adapters.safetensors").is_file():
            model, _ = mlx_load(str(Path(target.base).expanduser()), adapter_path=str(target.weights))
        else:
            model, _ = mlx_load(str(target.weights))
        tokenizer = AutoTokenizer.from_pretrained(_tokenizer_folder(target))
    except (OSError, ValueError, KeyError) as exc:
        raise TargetError(f"mlx-lm cannot load {target.weights} (base {target.base}): {exc}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Loaded(model, tokenizer, "mlx")


def stop_ids(loaded: Loaded) -> set[int]:
    """The tokens at which the model's generation config stops a row."""
    eos = loaded.model.generation_config.eos_token_id if loaded.engine == "transformers" else None
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def cut(ids: Sequence[int], stops: set[int]) -> list[int]:
    """A row's generated tokens up to and with its first stop token (what follows is padding)."""
    out: list[int] = []
    for token in ids:
        out.append(int(token))
        if token in stops:
            break
    return out


@dataclass
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def generate_kwargs(self) -> dict[str, Any]:
        if self.temperature <= 0:
            # the model's generation config may ask for sampling: greedy is what was asked
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}


def generate(loaded: Loaded, prompts: Sequence[Sequence[int]], sampling: Sampling, *, batch_size: int = 16,
             progress: Callable[[int], None] | None = None, streamer: Any = None) -> list[list[int]]:
    """Each prompt's generated token ids (stop token included), in order; batches of ``batch_size`` with
    left padding, as a plain batched ``model.generate`` runs them."""
    if loaded.engine == "mlx":
        return _generate_mlx(loaded, prompts, sampling, progress)
    import torch
    from transformers import set_seed

    set_seed(sampling.seed)
    model, tokenizer = loaded.model, loaded.tokenizer
    stops = stop_ids(loaded)
    device = next(model.parameters()).device
    results: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start:start + batch_size]]
        batch = tokenizer.pad({"input_ids": chunk}, padding=True, return_tensors="pt").to(device)
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=sampling.max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, streamer=streamer,
                                 **sampling.generate_kwargs())
        width = batch["input_ids"].shape[1]
        results.extend(cut(row[width:].tolist(), stops) for row in out)
        if progress is not None:
            progress(len(results))
    return results


def _generate_mlx(loaded: Loaded, prompts: Sequence[Sequence[int]], sampling: Sampling,
                  progress: Callable[[int], None] | None) -> list[list[int]]:
    """One prompt at a time through mlx-lm's ``stream_generate`` (what ``mlx_lm.generate`` runs). Its last
    response carries the stop token (or the last token, at --max-new-tokens), so the ids are those of a
    transformers row: up to and with the stop token."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(sampling.seed)
    sampler = make_sampler(temp=max(sampling.temperature, 0.0), top_p=sampling.top_p)
    results: list[list[int]] = []
    for prompt in prompts:
        ids = [int(r.token) for r in stream_generate(loaded.model, loaded.tokenizer, list(prompt),
                                                     max_tokens=sampling.max_new_tokens, sampler=sampler)]
        results.append(ids)
        if progress is not None:
            progress(len(results))
    return results
