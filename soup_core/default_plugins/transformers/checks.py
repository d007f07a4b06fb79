"""What the transformers backend can check before it loads any weights, so ``soup train --dry-run`` fails
where the run would: the base (a model folder whose config and tokenizer load, or a hub id that is cached
when offline), every ``training.report_to`` tracker (it imports), and an output path that runs into a file or
cannot be written.

Each check returns None, or one message that says what is wrong, where, and how to fix it. Only the base's
config and tokenizer are read, never its weights; a model folder that passed is remembered under
``$SOUP_HOME/cache/bases.json`` (by its files' content and this installation), so the next dry run of it
imports no torch.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: Files of which a saved tokenizer has at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def offline() -> bool:
    """True when the Hugging Face hub must not be reached (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def looks_local(base: str) -> bool:
    """A hub id is ``name`` or ``org/name``; anything else that names a path, or exists, is a folder."""
    return (base.startswith((".", "/", "~")) or "\\" in base or base.count("/") > 1
            or Path(os.path.expanduser(base)).exists())


def base_problem(base: str, *, what: str = "base") -> str | None:
    """None when ``base`` is a model folder whose config and tokenizer load, or a hub id (cached, when
    offline); else why not, naming ``what`` (the config key or option it came from)."""
    if not looks_local(base):
        if not offline():
            return None  # downloaded on first use; nothing to check without the network
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(base, "config.json"), str):
            return None
        return (f"{what}: {base!r} is a hub model id that is not in the local cache, and the hub is offline "
                "(HF_HUB_OFFLINE); download it once online (`hf download " + base + "`), or give a model folder")
    from soup_core.default_plugins.transformers.gguf import inspect_base

    gguf = inspect_base(base, what=what)  # a .gguf file: only its header is read
    if gguf is not None:
        return gguf[1]
    folder = Path(os.path.expanduser(base))
    if not folder.exists():
        return f"{what}: model folder {base!r} does not exist; give a model folder or a hub model id"
    if not folder.is_dir():
        return (f"{what}: {base!r} is a file, not a model folder or a .gguf file; give the folder that holds "
                "config.json, or a GGUF file")
    if not (folder / "config.json").is_file():
        return (f"{what}: {base!r} is not a model folder (it has no config.json); give a folder written by "
                "save_pretrained, or a hub model id")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return (f"{what}: {base!r} has a model but no tokenizer (none of {', '.join(TOKENIZER_FILES[:2])}); "
                "save the tokenizer into that folder (tokenizer.save_pretrained)")
    key = _fingerprint(folder)
    if key is not None and _kept_class(key):
        return None  # this installation loaded these very files before (importing torch to do so)
    from transformers import AutoConfig, AutoTokenizer

    from soup_core.default_plugins.transformers.loading import quiet_progress

    for kind, loader in (("config", AutoConfig), ("tokenizer", AutoTokenizer)):
        try:
            with quiet_progress():
                loaded = loader.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the user's folder to fix
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"{what}: the {kind} in {base!r} does not load: {first}"
    if key is not None:
        _keep(key, type(loaded))
    return None


def load_tokenizer(base: str) -> Any:
    """The base's tokenizer, as ``AutoTokenizer`` loads it (local files only). For a model folder whose check
    passed under this installation, the class ``AutoTokenizer`` chose then is loaded directly: the auto
    classes import torch (seconds), which nothing else in a dry run needs. A GGUF base's tokenizer is read
    from its dequantised folder when one is kept, else from the file."""
    from soup_core.default_plugins.transformers import gguf

    found = gguf.gguf_file(base)
    if found is not None:
        kept = gguf.kept_folder(found)
        from transformers import AutoTokenizer

        if kept is not None:
            return AutoTokenizer.from_pretrained(str(kept), local_files_only=True)
        return AutoTokenizer.from_pretrained(str(found.parent), gguf_file=found.name, local_files_only=True)
    folder = Path(os.path.expanduser(base))
    key = _fingerprint(folder) if looks_local(base) and folder.is_dir() else None
    kept = _kept_class(key) if key is not None else None
    if kept:
        module, _, name = kept.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            cls = None  # transformers changed under the same version stamp: ask AutoTokenizer
        if cls is not None:
            return cls.from_pretrained(str(folder), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base, local_files_only=True)


#: endings of weight files, which a base check never reads (so they do not decide its verdict)
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
_KEPT = 64


def _fingerprint(folder: Path) -> str | None:
    """What decides a base check: the folder's resolved path (transformers matches it against model names)
    and the content of each of its files but the weights. None for a folder with remote code (``auto_map``),
    which is always loaded afresh, or one that cannot be read."""
    import hashlib

    digest = hashlib.sha256(str(folder.resolve()).encode())
    try:
        for name in sorted(os.listdir(folder)):
            path = folder / name
            if name.endswith(_WEIGHTS) or not path.is_file():
                continue
            data = path.read_bytes()
            if name.endswith("config.json") and b'"auto_map"' in data:
                return None
            digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    except OSError:
        return None
    return digest.hexdigest()


def _verdicts() -> tuple[Path, str, dict[str, str]]:
    from soup_core.io import read_json_object
    from soup_core.probes import installation_key
    from soup_core.tracker.store import soup_home

    path, env = soup_home() / "cache" / "bases.json", installation_key()
    cached = read_json_object(path) or {}
    kept = cached.get("passed")
    return path, env, kept if cached.get("env") == env and isinstance(kept, dict) else {}


def _kept_class(key: str) -> str | None:
    """The tokenizer class (``module:name``) of a base whose check passed with these files, if kept."""
    kept = _verdicts()[2].get(key)
    return kept if isinstance(kept, str) and ":" in kept else None


def _keep(key: str, tokenizer_class: type) -> None:
    import contextlib
    import json

    from soup_core.io import atomic_write

    path, env, kept = _verdicts()
    kept.pop(key, None)
    kept[key] = f"{tokenizer_class.__module__}:{tokenizer_class.__qualname__}"
    kept = dict(list(kept.items())[-_KEPT:])  # bounded: the bases checked last
    with contextlib.suppress(OSError):  # a verdict that cannot be kept only costs the next run time
        atomic_write(path, json.dumps({"env": env, "passed": kept}, indent=1))


def report_to_problem(names: Iterable[str] | str | None) -> str | None:
    """None when every ``training.report_to`` tracker imports; else which does not, and what to install."""
    from soup_core.default_plugins.transformers.backend import REPORTERS

    if not names:
        return None
    for name in [names] if isinstance(names, str) else list(names):
        modules, package = REPORTERS.get(name, ((name,), name))
        errors = []
        for module in modules:
            try:
                importlib.import_module(module)
                break
            except Exception as exc:  # noqa: BLE001 - a tracker that is broken is as unusable as a missing one
                errors.append(f"{module}: {type(exc).__name__}: {exc}")
        else:
            return (f"training.report_to: {name} does not import ({'; '.join(errors)}); run: pip install "
                    f"{package} (or remove {name} from training.report_to)")
    return None


def output_problem(output_dir: Path, *, what: str = "output") -> str | None:
    """None unless the run could not create or write its output folder: some part of ``output_dir`` is an
    existing file, or the folder (or its nearest existing parent) is not writable."""
    path = Path(output_dir)
    for part in [path, *path.parents]:
        if part.exists():
            if not part.is_dir():
                return (f"{what}: {str(part)!r} is a file, so the output folder {str(path)!r} cannot be "
                        "created there; choose another output path (-o)")
            return _unwritable(part, path, what)
    return None


def _unwritable(folder: Path, path: Path, what: str) -> str | None:
    # os.access rather than a probe file: a dry run writes nothing (for root it sees only read-only mounts)
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    where = "the output folder" if folder == path else f"{str(folder)!r}, where the output folder would be created"
    read_only = hasattr(os, "statvfs") and bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    why = "it is on a read-only file system" if read_only else "this user may not write there"
    return (f"{what}: cannot write into {where} ({str(path)!r}): {why}; choose another output path (-o), "
            "or fix its permissions")
