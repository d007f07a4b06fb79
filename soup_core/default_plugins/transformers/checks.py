"""What the transformers backend can check before it loads any weights, so ``soup train --dry-run`` fails
where the run would: the base (a model folder whose config and tokenizer load, or a hub id that is cached
when offline), every ``training.report_to`` tracker (it imports), and an output path that runs into a file or
cannot be written.

Each check returns None, or one message that says what is wrong, where, and how to fix it. Only the base's
config and tokenizer are read, never its weights.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from pathlib import Path

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
    folder = Path(os.path.expanduser(base))
    if not folder.exists():
        return f"{what}: model folder {base!r} does not exist; give a model folder or a hub model id"
    if not folder.is_dir():
        return f"{what}: {base!r} is a file, not a model folder; give the folder that holds config.json"
    if not (folder / "config.json").is_file():
        return (f"{what}: {base!r} is not a model folder (it has no config.json); give a folder written by "
                "save_pretrained, or a hub model id")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return (f"{what}: {base!r} has a model but no tokenizer (none of {', '.join(TOKENIZER_FILES[:2])}); "
                "save the tokenizer into that folder (tokenizer.save_pretrained)")
    from transformers import AutoConfig, AutoTokenizer

    from soup_core.default_plugins.transformers.loading import quiet_progress

    for kind, loader in (("config", AutoConfig), ("tokenizer", AutoTokenizer)):
        try:
            with quiet_progress():
                loader.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the user's folder to fix
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"{what}: the {kind} in {base!r} does not load: {first}"
    return None


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
