"""GGUF bases: ``base:`` may name a ``.gguf`` file (llama.cpp, Ollama, LM Studio), or a folder without a
``config.json`` that holds exactly one. Every place that loads a base asks :func:`resolve_base` for the folder
to load: for a GGUF base, a model folder dequantised from the file once (to float32, or the run's dtype) and
kept under ``$SOUP_HOME/cache/gguf`` by the file's SHA-256, the dtype and the transformers version; later
loads cost what any safetensors folder costs. The tokenizer and chat template come from the file.

A dry run reads the file's header only (the ``gguf`` package; no torch): :func:`inspect_base` says what the
file holds and what the dequantised model will cost in memory, and refuses an architecture or tensor type the
installed transformers cannot load, or a file that is cut short.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from soup_core.default_plugins.transformers.errors import BackendError

SUFFIX = ".gguf"
#: written last into a dequantised folder: what it came from (a folder without it is not complete)
RECORD = "soup_gguf.json"
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class GGUFError(BackendError):
    """A GGUF base that cannot be used; the message says what, where and how to fix it."""


def gguf_file(base: str | os.PathLike[str]) -> Path | None:
    """The GGUF file ``base`` names: a ``.gguf`` file, or a folder without ``config.json`` holding exactly one
    ``.gguf``. None for anything else (a model folder, a hub id, a path that does not exist)."""
    path = Path(os.path.expanduser(str(base)))
    if path.suffix.lower() == SUFFIX and path.is_file():
        return path
    found = _folder_ggufs(path)
    return found[0] if len(found) == 1 else None


def _folder_ggufs(path: Path) -> list[Path]:
    if not path.is_dir() or (path / "config.json").exists():
        return []  # a folder with a config.json is a model folder, whatever else it holds
    try:
        return sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    except OSError:
        return []


@dataclass
class Header:
    """What a GGUF file's header says (read by :func:`read_header`)."""

    path: Path
    architecture: str
    parameters: int
    tensors: int
    types: Counter = field(default_factory=Counter)  # tensor type name -> tensors of it
    vocabulary: int = 0
    tokenizer: str = ""
    chat_template: bool = False
    context_length: int | None = None

    def lines(self, dtype: str = "float32") -> list[str]:
        """What a dry run prints about the file."""
        dtype = dtype if dtype in _BYTES else "float32"
        types = ", ".join(f"{name} x{n}" for name, n in self.types.most_common())
        cost = self.parameters * _BYTES[dtype]
        cached = kept_folder(self.path, dtype)
        return [
            f"GGUF base {self.path.name}: architecture {self.architecture}, {self.tensors} tensors "
            f"({self.parameters / 1e6:,.1f}M parameters; {types})",
            f"GGUF tokenizer: {self.tokenizer or '?'} with {self.vocabulary:,} tokens, "
            + ("its own chat template" if self.chat_template else "no chat template")
            + (f", context {self.context_length:,}" if self.context_length else ""),
            f"GGUF dequantised to {dtype}: {_size(cost)} of weights in memory "
            f"(the file: {_size(self.path.stat().st_size)}); "
            + (f"already dequantised in {cached}" if cached else
               f"dequantised once on the first load, kept in {cache_root()}"),
        ]


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _file_key(path: Path) -> str:
    """What names one version of a file in the indexes below: its path, size, modification time and inode."""
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"


def read_header(path: Path) -> Header:
    """The file's header (``GGUFReader``: numpy only, the tensors are not read). GGUFError for a file that
    is not a GGUF file or is cut short. Parsing a 49k-token vocabulary takes seconds, so what a readable
    file's header says is kept under ``SOUP_HOME/cache/gguf/headers.json`` by :func:`_file_key` (and in this
    process): every later run of the same file reads that instead."""
    from soup_core.io import atomic_write, read_json_object

    key, index = _file_key(path), cache_root() / "headers.json"
    known = read_json_object(index) or {}
    kept = known.get(key)
    if isinstance(kept, dict):
        with contextlib.suppress(TypeError, ValueError):
            return Header(path=path, **{**kept, "types": Counter(kept.get("types") or {})})
    header = _read_header(path.resolve(), *key.rsplit("|", 3)[1:])
    fields = {k: v for k, v in vars(header).items() if k != "path"}
    known.pop(key, None)
    known[key] = {**fields, "types": dict(header.types)}
    with contextlib.suppress(OSError):  # a header that cannot be kept only costs the next run a read
        atomic_write(index, json.dumps(dict(list(known.items())[-32:]), indent=1))
    return Header(path=path, **fields)


@functools.lru_cache(maxsize=8)
def _read_header(path: Path, *version: str) -> Header:
    # ``version`` (size, mtime, inode) only keys the cache: a file changed in place is read again
    size = path.stat().st_size
    try:
        from gguf import GGUFReader
    except ImportError:  # pragma: no cover - a dependency of Soup's transformers backend
        raise GGUFError(f"base: {str(path)!r} is a GGUF file, and reading it needs the gguf package: "
                        "pip install gguf") from None
    try:
        reader = GGUFReader(str(path))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as exc:  # noqa: BLE001 - GGUFReader raises whatever numpy does on a cut or corrupt file
        raise GGUFError(f"base: {str(path)!r} is not a readable GGUF file ({type(exc).__name__}: "
                        f"{str(exc).strip()[:120]}); it may be cut short or corrupt: download it again") from None
    if end > size or not reader.tensors:
        raise GGUFError(f"base: {str(path)!r} is cut short: its tensors need {end:,} bytes and the file has "
                        f"{size:,}; download it again")

    def value(key: str) -> Any:
        entry = reader.fields.get(key)
        return None if entry is None else entry.contents()

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    arch = str(value("general.architecture") or "?")
    context = value(f"{arch}.context_length")
    return Header(
        path=path, architecture=arch, parameters=sum(int(t.n_elements) for t in reader.tensors),
        tensors=len(reader.tensors), types=Counter(t.tensor_type.name for t in reader.tensors),
        vocabulary=len(tokens.data) if tokens is not None else 0, tokenizer=str(value("tokenizer.ggml.model") or ""),
        chat_template=bool(value("tokenizer.chat_template")), context_length=int(context) if context else None,
    )


def supported() -> dict[str, set[str]]:
    """The architectures the installed transformers loads from GGUF, each with the tensor types it can
    dequantise. Read from transformers' own tables (both torch-free): the loader of
    ``modeling_gguf_pytorch_utils`` (its architectures: ``integrations.ggml.GGUF_CONFIG_MAPPING``) dequantises
    with ``gguf.dequantize`` (F32, F16 and gguf's quantisation table); the newer one
    (``integrations.gguf.GGUF_CONFIG_ARCHS``) with its own kernels (``integrations/gguf/dequant.py``'s
    ``GGML_NAME``, read as text: that module imports torch)."""
    import importlib.util

    from gguf.quants import _type_traits  # the table gguf.dequantize dispatches on
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    legacy = {"F32", "F16"} | {t.name for t in _type_traits}
    tables = dict.fromkeys(GGUF_CONFIG_MAPPING, legacy)
    with contextlib.suppress(ImportError, OSError, SyntaxError, AttributeError):  # an older transformers
        from transformers.integrations.gguf.gguf_config_mapping import GGUF_CONFIG_ARCHS

        spec = importlib.util.find_spec("transformers.integrations.gguf.dequant")
        newer = {"F32", "F16", "BF16"} | _dict_values(Path(spec.origin), "GGML_NAME")
        tables.update(dict.fromkeys(GGUF_CONFIG_ARCHS, newer))
    return tables


def _dict_values(source: Path, name: str) -> set[str]:
    import ast

    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return {v.value for v in getattr(node.value, "values", []) if isinstance(v, ast.Constant)}
    return set()


def header_problem(header: Header, *, what: str = "base") -> str | None:
    """None when the installed transformers can load this file; else one message naming what it can."""
    tables = supported()
    arch = header.architecture
    if arch not in tables:
        return (f"{what}: {str(header.path)!r} is a GGUF file of architecture {arch!r}, which the installed "
                f"transformers cannot load from GGUF (it loads: {', '.join(sorted(tables))}); convert the model "
                "to a model folder, or use a GGUF file of one of those")
    unknown = sorted(set(header.types) - tables[arch])
    if unknown:
        return (f"{what}: {str(header.path)!r} holds tensors of type {', '.join(unknown)}, which the installed "
                f"transformers cannot dequantise for {arch} (it can: {', '.join(sorted(tables[arch]))}); use a "
                "GGUF file quantised with one of those")
    return None


def inspect_base(base: str, *, what: str = "base") -> tuple[Header | None, str | None] | None:
    """None when ``base`` is no GGUF base; else (its header, None) or (None or the header, the problem)."""
    path = Path(os.path.expanduser(base))
    if path.suffix.lower() == SUFFIX and not path.exists():
        return None, f"{what}: GGUF file {base!r} does not exist; give the path of a .gguf file"
    several = _folder_ggufs(path)
    if len(several) > 1:
        return None, (f"{what}: {base!r} has no config.json and holds {len(several)} GGUF files "
                      f"({', '.join(p.name for p in several[:4])}); name the one to use: {what}: "
                      f"{several[0]}")
    found = gguf_file(base)
    if found is None:
        return None
    try:
        header = read_header(found)
    except GGUFError as exc:
        return None, str(exc).replace("base:", f"{what}:", 1)
    return header, header_problem(header, what=what)


# ---- the dequantised folder cache


def cache_root() -> Path:
    """Where dequantised GGUF bases are kept (``soup cache list`` shows them, ``soup cache clear`` clears)."""
    from soup_core.tracker.store import soup_home

    return soup_home() / "cache" / "gguf"


def _transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:  # pragma: no cover
        return "none"


def file_sha256(path: Path) -> str:
    """The file's SHA-256, hashed once per (path, size, mtime, inode): later loads read a small index instead
    of the whole file again (seconds for a large model)."""
    from soup_core.io import atomic_write, read_json_object

    key, index = _file_key(path), cache_root() / "sha256.json"
    known = read_json_object(index) or {}
    if isinstance(known.get(key), str):
        return known[key]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    known.pop(key, None)
    known[key] = digest.hexdigest()
    with contextlib.suppress(OSError):  # an index that cannot be kept only costs the next load a hash
        atomic_write(index, json.dumps(dict(list(known.items())[-64:]), indent=1))
    return known[key]


def _entry_name(sha: str, dtype: str) -> str:
    return f"{sha[:24]}-{dtype}-tf{_transformers_version()}"


def kept_folder(path: Path, dtype: str | None = None) -> Path | None:
    """The complete dequantised folder of ``path`` in ``dtype`` (None: in any), if one is kept; by the hash
    index, so the file is not read."""
    from soup_core.io import read_json_object

    key = _file_key(path)
    sha = (read_json_object(cache_root() / "sha256.json") or {}).get(key)
    for name in [dtype] if dtype else list(_BYTES):
        folder = cache_root() / _entry_name(sha, name) if isinstance(sha, str) else None
        if folder is not None and (folder / RECORD).is_file():
            return folder
    return None


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _BYTES:
        raise GGUFError(f"a GGUF base is dequantised to float32, bfloat16 or float16; not {name!r}")
    return name


def source_record(base: str) -> dict[str, str] | None:
    """``{"path", "sha256"}`` of a GGUF base (what a run and its model card record); None for another base."""
    found = gguf_file(base)
    return None if found is None else {"path": str(found.resolve()), "sha256": file_sha256(found)}


def resolve_base(base: str | os.PathLike[str], dtype: Any = "float32", *,
                 report: Callable[[str], Any] | None = print) -> str:
    """The folder to load for ``base``: ``base`` itself, unless it is a GGUF base; then its dequantised model
    folder in ``dtype`` (a torch dtype or its name), built on first use. GGUFError for a file that cannot be
    loaded, with the reason."""
    found = gguf_file(base)
    if found is None and str(base).lower().endswith(SUFFIX) and not Path(os.path.expanduser(str(base))).exists():
        # a run's GGUF base that moved: else transformers reads the path as a hub id and says so
        raise GGUFError(f"GGUF file {str(base)!r} does not exist (moved or deleted?); give the path of a .gguf file")
    if found is None:
        return str(base)
    from soup_core.data import cache as locks  # the data cache's entry locks, which soup cache clear respects

    name = _dtype_name(dtype)
    target = cache_root() / _entry_name(file_sha256(found), name)
    lock, handle = target.parent / f".{target.name}.lock", None
    with contextlib.suppress(OSError):  # a read-only cache still serves its folders; only clear's skip is lost
        target.parent.mkdir(parents=True, exist_ok=True)
        handle = locks.hold(lock)
    try:
        if not (target / RECORD).is_file():
            inspected = inspect_base(str(found))
            if inspected is not None and inspected[1]:
                raise GGUFError(inspected[1])
            with locks.filling(lock):  # one process dequantises; another waits, then loads its folder
                if not (target / RECORD).is_file():
                    _dequantise(found, name, target, report or (lambda _: None))
        locks.retain(lock, handle)  # shared until this process exits: soup cache clear skips the folder
    except BaseException:
        if handle is not None:
            handle.close()
        raise
    return str(target)


def _dequantise(path: Path, dtype: str, target: Path, report: Callable[[str], Any]) -> Path:
    """Dequantise ``path`` into ``target``: transformers loads the file (``gguf_file=``), and its weights go,
    unchanged, into a plain model built from the same config without the GGUF quantisation config (which a
    saved folder would otherwise carry into every later load); then the file's tokenizer and chat template.
    Written into a temporary folder and renamed, so a cut run leaves no half folder."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    started = time.monotonic()
    report(f"dequantising {path.name} to {dtype} (once; kept in {target.parent}) ...")
    torch_dtype = getattr(torch, dtype)
    target.parent.mkdir(parents=True, exist_ok=True)
    # named as the data cache names a folder being filled, so soup cache clear finds its lock
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    from transformers import modeling_gguf_pytorch_utils as gguf_loader

    bars, bar = hf_logging.is_progress_bar_enabled(), getattr(gguf_loader, "tqdm", None)
    hf_logging.disable_progress_bar()  # transformers' per-file bars; the message above says what is going on
    if bar is not None:  # its own tqdm, which that switch does not reach: off here only, put back below
        gguf_loader.tqdm = functools.partial(bar, disable=True)
    try:
        try:
            loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch_dtype)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except (OSError, ValueError, KeyError, NotImplementedError) as exc:
            raise GGUFError(f"base: transformers cannot load the GGUF file {str(path)!r}: "
                            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
                            ) from None
        config = copy.deepcopy(loaded.config)
        with contextlib.suppress(AttributeError):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        plain.load_state_dict(loaded.state_dict(), strict=True)
        del loaded
        plain.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        from soup_core.io import atomic_write, umask

        for file in tmp.iterdir():  # safetensors writes its file 0600: every file follows the umask, as others do
            os.chmod(file, 0o666 & ~umask())

        atomic_write(tmp / RECORD, json.dumps({
            "path": str(path.resolve()), "sha256": file_sha256(path), "dtype": dtype,
            "transformers": _transformers_version(), "built": time.time()}, indent=1))
        os.chmod(tmp, 0o777 & ~umask())
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished the same folder first: theirs is as good
            if not (target / RECORD).is_file():
                raise
    finally:
        if bar is not None:
            gguf_loader.tqdm = bar
        if bars:
            hf_logging.enable_progress_bar()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    report(f"dequantised in {time.monotonic() - started:.0f} s: {target}")
    return target


def entries() -> list[dict[str, Any]]:
    """Every kept dequantised folder: name, bytes, the GGUF file, dtype and when it was built."""
    from soup_core.io import read_json_object

    root, found = cache_root(), []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        record = read_json_object(folder / RECORD) if folder.is_dir() else None
        if record:
            size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
            found.append({"name": folder.name, "bytes": size, **record})
    return found


def clear() -> tuple[int, int, dict[str, list[int]]]:
    """Remove every dequantised folder no live process uses or builds (and the hash and header indexes);
    (folders removed, bytes freed, {folder skipped: the pids using it})."""
    from soup_core.data.cache import remove_folder

    root = cache_root()
    n, freed, skipped = 0, 0, {}
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if folder.is_dir() and (size := remove_folder(folder, skipped)) is not None:
            n, freed = n + 1, freed + size
    for index in ("sha256.json", "headers.json"):
        with contextlib.suppress(OSError):
            (root / index).unlink()
    return n, freed, skipped
