"""What the mlx backend writes and reads: mlx-lm adapters, full models, checkpoints, and the conversion
of an mlx-lm LoRA adapter into a PEFT adapter that transformers loads.

Formats:

- **LoRA adapter** (mlx-lm's own): ``adapters.safetensors`` (``<module>.lora_a`` of shape (in, r) and
  ``<module>.lora_b`` of shape (r, out)) and ``adapter_config.json`` (``fine_tune_type``, ``num_layers``,
  ``lora_parameters`` with ``rank``/``scale``/``dropout``/``keys``). ``keys`` holds the full module names,
  so ``mlx_lm.load(base, adapter_path=...)`` and ``mlx_lm generate --adapter-path`` rebuild exactly the
  layers that were trained. A ``soup`` section adds r, alpha and the resolved target modules.
- **Full model** (``lora.r: 0``): ``model.safetensors`` + ``config.json`` + tokenizer: a model folder
  that both ``mlx_lm.load`` and transformers read.
- **Checkpoint** ``checkpoint-<step>/``: the trainable weights in mlx-lm's adapter format, the optimizer
  state, and ``trainer_state.json`` (``global_step``, the random state).
- **PEFT adapter**: ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` = lora_aᵀ,
  ``lora_B.weight`` = lora_bᵀ) and ``adapter_config.json`` with ``lora_alpha = scale · r``.

The conversion needs mlx only (no torch): a Mac can export without the transformers stack.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from soup_core import atomic_write

ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_STATE = "optimizer.safetensors"
TRAINER_STATE = "trainer_state.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


class AdapterError(ValueError):
    """A folder is not the adapter it should be, or cannot be converted (says what and how to fix)."""


def save_safetensors(path: Path, arrays: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """``mx.save_safetensors`` through a temp file and a rename (readers never see half a file)."""
    import mlx.core as mx

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        mx.save_safetensors(tmp, arrays, metadata=metadata or {})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


#: The core's name for a temp folder a save writes before it renames: a leftover (a killed process) is never
#: taken for a checkpoint, and counts as the run's own file, which ``soup train --overwrite`` removes.
TMP_PREFIX = ".soup-tmp-"


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


@contextmanager
def building(folder: Path) -> Iterator[Path]:
    """Build a folder beside ``folder`` and rename it into place at the end (replacing an old one)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{folder.name}.", dir=folder.parent))
    tmp.chmod(0o777 & ~_umask())  # kept once renamed: the usual mode of a folder, not mkdtemp's 0700
    try:
        yield tmp
        if folder.exists():
            old = folder.with_name(f"{TMP_PREFIX}{folder.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def filling(folder: Path) -> Iterator[Path]:
    """Write the files of ``folder`` into a temp folder inside it, then rename each into place; what else
    ``folder`` holds (the run's config, logs, checkpoints) stays. A failed write leaves none of them."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}final.", dir=folder))
    try:
        yield tmp
        for entry in sorted(tmp.iterdir()):
            target = folder / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(entry, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def mlx_adapter_config(*, base: str, n_layers: int, info: dict[str, Any], lora: Any) -> dict[str, Any]:
    """mlx-lm's ``adapter_config.json`` for what :func:`soup_plugin_mlx.model.make_trainable` did."""
    if not info["adapter"]:
        return {
            "fine_tune_type": "full",
            "num_layers": n_layers,
            "model": base,
            "base_model_name_or_path": base,
            "soup": {"backend": "mlx", "dtype": info["dtype"]},
        }
    return {
        "fine_tune_type": "lora",
        "num_layers": n_layers,
        "model": base,
        "base_model_name_or_path": base,
        "lora_parameters": {
            "rank": int(lora.r),
            "scale": float(info["scale"]),
            "dropout": float(lora.dropout),
            "keys": list(info["modules"]),
        },
        "soup": {
            "backend": "mlx",
            "r": int(lora.r),
            "alpha": lora.alpha,
            "target_modules": list(info["targets"]),
            "dtype": info["dtype"],
        },
    }


def save_tokenizer(folder: Path, tokenizer: Any) -> None:
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))


def trainable_weights(model: Any) -> dict[str, Any]:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(model.trainable_parameters()))


def write_adapter(folder: Path, model: Any, adapter_config: dict[str, Any]) -> None:
    """The trainable weights and config in mlx-lm's adapter format (into an existing folder)."""
    save_safetensors(folder / ADAPTER_WEIGHTS, trainable_weights(model), {"format": "mlx"})
    write_json(folder / ADAPTER_CONFIG, adapter_config)


def write_full_model(folder: Path, model: Any, model_config: dict[str, Any]) -> None:
    """Every weight plus ``config.json``: a model folder mlx-lm and transformers load."""
    from mlx_lm.utils import save_config, save_model

    save_model(folder, model)
    save_config(dict(model_config), folder / "config.json")


def load_trainable(model: Any, folder: Path) -> None:
    """Load the trainable weights saved by :func:`write_adapter` (names and shapes must match)."""
    import mlx.core as mx

    weights = mx.load(str(folder / ADAPTER_WEIGHTS))
    expected = trainable_weights(model)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(weights) & set(expected) if weights[k].shape != expected[k].shape)
    if missing or extra or wrong:
        detail = "; ".join(
            part
            for part in (
                f"missing {', '.join(missing[:3])}" if missing else "",
                f"unexpected {', '.join(extra[:3])}" if extra else "",
                f"wrong shape {', '.join(wrong[:3])}" if wrong else "",
            )
            if part
        )
        raise AdapterError(
            f"{folder} does not match this run's trainable weights ({detail}); resume with the same "
            "training.lora settings and base model the checkpoint was trained with"
        )
    model.load_weights([(k, v.astype(expected[k].dtype)) for k, v in weights.items()], strict=False)


# ------------------------------------------------------------------------------------------ PEFT export


def read_mlx_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapter config, weights) of an mlx-lm LoRA adapter folder; refuses anything else clearly."""
    import mlx.core as mx

    config_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights_file.is_file():
        hint = " (it looks like a PEFT adapter already)" if (folder / PEFT_WEIGHTS).is_file() else ""
        raise AdapterError(
            f"{folder} holds no mlx-lm adapter ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} are needed){hint}; "
            "pass the output folder of a `backend: mlx` LoRA run"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise AdapterError(f"{config_file} is not valid JSON: {exc}") from exc
    kind = config.get("fine_tune_type", "lora")
    if kind == "full":
        raise AdapterError(
            f"{folder} holds fully fine-tuned weights, not a LoRA adapter; a `training.lora.r: 0` run "
            "writes a model folder that transformers loads directly"
        )
    if kind != "lora":
        raise AdapterError(f"{folder} holds a {kind} adapter; only LoRA adapters convert to PEFT")
    return config, mx.load(str(weights_file))


def export_peft(
    adapter_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, base: str | None = None
) -> Path:
    """Convert the mlx-lm LoRA adapter in ``adapter_dir`` into a PEFT adapter folder ``out_dir``.

    Every ``<module>.lora_a``/``lora_b`` pair becomes PEFT's ``lora_A``/``lora_B`` (transposed); the
    scale is kept as ``lora_alpha / r``; ``target_modules`` lists the converted modules by full name.
    """
    import mlx.core as mx

    source, out = Path(adapter_dir), Path(out_dir)
    config, weights = read_mlx_adapter(source)
    if out.resolve() == source.resolve():
        raise AdapterError(
            "the PEFT adapter needs its own folder (both formats name their config "
            f"{ADAPTER_CONFIG}); choose another --output"
        )
    if out.exists() and any(out.iterdir()):
        raise AdapterError(f"{out} exists and is not empty; choose another output folder")
    params = config.get("lora_parameters") or {}
    modules = sorted({name.rsplit(".", 1)[0] for name in weights if name.endswith((".lora_a", ".lora_b"))})
    others = sorted(name for name in weights if not name.endswith((".lora_a", ".lora_b")))
    if others:
        raise AdapterError(
            f"{source} holds weights that are not LoRA matrices ({', '.join(others[:3])}); "
            "only plain LoRA adapters convert to PEFT"
        )
    if not modules:
        raise AdapterError(f"{source / ADAPTER_WEIGHTS} holds no LoRA weights")
    tensors: dict[str, Any] = {}
    rank = None
    for module in modules:
        a, b = weights.get(f"{module}.lora_a"), weights.get(f"{module}.lora_b")
        if a is None or b is None or a.ndim != 2 or b.ndim != 2:
            raise AdapterError(
                f"{module}: needs a 2-D lora_a and lora_b (mixture-of-experts LoRA layers do not "
                "convert to PEFT)"
            )
        rank = int(a.shape[1]) if rank is None else rank
        if a.shape[1] != rank or b.shape[0] != rank:
            raise AdapterError(f"{module}: rank {a.shape[1]} differs from the others' {rank}")
        tensors[f"base_model.model.{module}.lora_A.weight"] = mx.contiguous(a.T)
        tensors[f"base_model.model.{module}.lora_B.weight"] = mx.contiguous(b.T)
    scale = float(params.get("scale", 0.0))
    if scale <= 0:
        raise AdapterError(f"{source / ADAPTER_CONFIG}: lora_parameters.scale is missing")
    alpha_value = scale * rank
    alpha: float | int = (
        int(round(alpha_value)) if abs(alpha_value - round(alpha_value)) < 1e-9 else alpha_value
    )
    base_model = base or config.get("base_model_name_or_path") or config.get("model")
    if not base_model:
        raise AdapterError(
            f"{source / ADAPTER_CONFIG} does not say which base model it belongs to; pass --base"
        )
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": float(params.get("dropout", 0.0)),
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.rmdir()
    with building(out) as tmp:
        save_safetensors(tmp / PEFT_WEIGHTS, tensors, {"format": "pt"})
        write_json(tmp / ADAPTER_CONFIG, peft_config)
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
        _write_run_config(source, tmp, base)
    return out


def _write_run_config(source: Path, out: Path, base: str | None) -> None:
    """Write the run's config (from its model card, the tracker or its ``soup_config.yaml``) into ``out`` as a
    transformers run of the same recipe, so ``soup eval``/``soup generate`` take the exported folder as a run
    (its chat template, encoding and base), as they take a transformers run's output."""
    import yaml

    from soup_core.tracker import run_of_folder

    run = run_of_folder(source)
    if run is None:
        return  # a plain mlx-lm adapter: no Soup run to carry
    config = {**run.config, "backend": "transformers"}
    if base:
        config["base"] = base
    (out / "soup_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
