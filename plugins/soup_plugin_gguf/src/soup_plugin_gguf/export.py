"""``soup export TARGET --to gguf`` and ``--to ollama``: find the weights TARGET names, merge an adapter first,
write the GGUF file (:mod:`soup_plugin_gguf.convert`), its model card and, for Ollama, a Modelfile.

TARGET is resolved as ``soup generate`` resolves it (the eval plugin's ``target.resolve``: an output folder,
a checkpoint, a run id, ``latest``), or is a plain model folder (``config.json``), or a ``.gguf`` file (a GGUF
base: its dequantised folder, as a run loads it). An adapter is merged as ``soup merge`` merges it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import typer

from soup_plugin_gguf.convert import TYPES, ExportError, write_gguf

DEFAULT_TYPE = "f16"  # llama.cpp's converter's default too: half the size of f32, no visible loss


@dataclass
class Source:
    """The model folder to write and what is known of where it came from."""

    folder: Path
    label: str  # a short name: the run's folder, or the file's
    near: Path  # where the default output goes (beside TARGET)
    base: dict[str, str] | None  # the GGUF base: {"path", "sha256"}; None for another base
    run_id: str | None = None
    template: str | None = None  # the run's data.chat_template (a shipped name, or inline Jinja); None: the base's


def _fail(message: str) -> NoReturn:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(1)


def _say(message: str) -> None:
    from rich.markup import escape

    from soup_core import console

    console.print(escape(message))


@contextlib.contextmanager
def _source(spec: str) -> Iterator[Source]:
    """Resolve ``spec``; an adapter is merged into a temporary folder, removed when the block ends."""
    from soup_core.default_plugins.transformers import gguf_file, resolve_base, source_record

    path = Path(spec).expanduser()
    if path.is_file() and gguf_file(path) is not None:
        folder = Path(resolve_base(str(path), "float32", report=_say))
        yield Source(folder, path.stem, path.parent, source_record(str(path)))
        return
    from soup_plugin_eval.target import TargetError, resolve

    try:
        target = resolve(spec)
    except TargetError as exc:
        if path.is_dir() and (path / "config.json").is_file():  # a model folder no run wrote
            yield Source(path.resolve(), path.resolve().name, path.resolve().parent, None)
            return
        _fail(str(exc))
    base = source_record(target.base)
    near = (target.run_dir or target.weights).parent
    label = target.label.replace("/", "-")
    template = getattr(target.config.data, "chat_template", None)
    if target.kind == "mlx":
        _fail(f"{target.weights} was trained by the mlx backend; convert it first: soup export {spec} --to peft -o "
              f"PEFT, then soup merge PEFT -o MERGED, then soup export MERGED --to gguf")
    if target.kind == "model":
        yield Source(target.weights, label, near, base, target.run_id, template)
        return
    from soup_core.default_plugins.transformers import BackendError, merge_adapter

    tmp = Path(tempfile.mkdtemp(prefix=".soup-export-"))
    try:
        _say(f"merging the adapter {target.weights} into {target.base} (as soup merge does) ...")
        try:
            folder = merge_adapter(target.base, target.weights, tmp / "merged")
        except (BackendError, OSError, ValueError) as exc:
            _fail(f"cannot merge {target.weights} into its base {target.base}: {exc}")
        yield Source(folder, label, near, base, target.run_id, template)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _base_facts(base: dict[str, str] | None) -> tuple[str | None, dict[str, str] | None]:
    """The GGUF base's pre-tokenizer name and tensor types (name -> type), when the file is still there."""
    if base is None or not Path(base["path"]).is_file():
        return None, None
    import gguf

    reader = gguf.GGUFReader(base["path"])
    field = reader.fields.get("tokenizer.ggml.pre")
    return (field.contents() if field is not None else None), {t.name: t.tensor_type.name for t in reader.tensors}


def _kind(kind: str | None) -> str:
    kind = (kind or DEFAULT_TYPE).lower()
    if kind not in (*TYPES, "same"):
        _fail(f"--type {kind}: choose one of {', '.join(TYPES)}, or same (the GGUF base's own types)")
    return kind


def _type(kind: str, base_types: dict[str, str] | None, base: dict[str, str] | None) -> str:
    if kind != "same":
        return kind
    if base_types is None:
        where = f"its GGUF base {base['path']} is gone" if base else "it was not trained from a GGUF base"
        _fail(f"--type same keeps the GGUF base's tensor types, but {where}; give --type {'|'.join(TYPES)}")
    from soup_plugin_gguf.convert import writable_types

    writable = writable_types()
    missing = sorted({t for t in base_types.values() if t not in writable})
    if missing:
        _fail(f"--type same: the GGUF base {base['path']} holds {', '.join(missing)} tensors, which the installed "
              f"gguf package cannot write; it writes {', '.join(writable)}: give --type {'|'.join(TYPES)}")
    return kind


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write(source: Source, out: Path, kind: str, pre: str | None, base_types: dict[str, str] | None) -> str:
    """Write the GGUF file with a progress line per tenth of the tensors; its SHA-256."""
    started, shown = time.monotonic(), [-1]

    def progress(done: int, total: int, name: str) -> None:
        tenth = done * 10 // total
        if tenth != shown[0]:
            shown[0] = tenth
            _say(f"  writing {out.name}: {done}/{total} tensors ({done * 100 // total}%), {name}")

    _say(f"writing {out} ({kind}) from {source.folder} ...")
    try:
        write_gguf(source.folder, out, kind, pre=pre, name=source.label, same=base_types if kind == "same" else None,
                   progress=progress)
    except ExportError as exc:
        _fail(str(exc))
    except OSError as exc:
        # numpy's tofile reports a short write without an errno: the disk is full or a size limit was reached
        reason = exc.strerror or f"the disk is full or a file size limit was reached ({exc})"
        _fail(f"cannot write {out}: {reason}; nothing was left behind. Free space on that disk "
              f"(the file needs about the model's size at --type {kind}) or give -o on another disk")
    sha = _sha256(out)
    _say(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {time.monotonic() - started:.0f} s; sha256 {sha}")
    return sha


def card(source: Source, gguf_name: str, kind: str, sha: str, extra: str = "") -> str:
    """The model card of an export: where it came from, its type, the GGUF base's and its own SHA-256."""
    from soup_core import __version__

    base = source.base
    rows = [("file", f"`{gguf_name}`"), ("SHA-256", f"`{sha}`"),
            ("tensor type", f"{kind} (2-D weights; norms and biases in f32)"),
            ("from", f"`{source.folder}`" + (f" (run `{source.run_id}`)" if source.run_id else ""))]
    if base:
        rows += [("GGUF base", f"`{base['path']}`"), ("GGUF base SHA-256", f"`{base['sha256']}`")]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    front = f"base_model: {json.dumps(base['path'] if base else source.label)}\n"
    return (f"---\n{front}library_name: gguf\ntags:\n- soup\n- gguf\n---\n# {source.label} (GGUF, {kind})\n\n"
            f"Exported by `soup export` (Soup {__version__}).\n\n| | |\n|---|---|\n{table}\n{extra}")


def run_gguf(spec: str, output: Path | None, kind: str | None) -> None:
    """``soup export TARGET --to gguf [--type T] [-o FILE.gguf]``."""
    from soup_core import atomic_write

    if output is not None and Path(output).suffix.lower() != ".gguf":
        _fail(f"-o {output}: a GGUF file name ends in .gguf")
    kind = _kind(kind)
    with _source(spec) as source:
        pre, base_types = _base_facts(source.base)
        kind = _type(kind, base_types, source.base)
        out = Path(output) if output is not None else source.near / f"{source.label}-{kind}.gguf"
        if out.exists():
            _fail(f"{out} exists; give another -o, or delete it first")
        sha = _write(source, out, kind, pre, base_types)
        atomic_write(out.with_suffix(".md"), card(source, out.name, kind, sha))


def run_ollama(spec: str, output: Path | None, kind: str | None) -> None:
    """``soup export TARGET --to ollama -o FOLDER``: the GGUF file, a Modelfile and the model card."""
    from soup_core import atomic_write
    from soup_plugin_gguf.ollama import OllamaError, modelfile

    if output is None:
        _fail("--to ollama needs -o FOLDER: where to write the GGUF file and its Modelfile (a new or empty folder)")
    folder = Path(output)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        _fail(f"{folder} exists and is not an empty folder; give another -o")
    kind = _kind(kind)
    with _source(spec) as source:
        pre, base_types = _base_facts(source.base)
        kind = _type(kind, base_types, source.base)
        name = f"{source.label}-{kind}.gguf"
        try:
            text = modelfile(source.folder, name, source.template)  # refused before anything is written
        except OllamaError as exc:
            _fail(str(exc))
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent if folder.parent.exists() else None))
        try:
            sha = _write(source, tmp / name, kind, pre, base_types)
            atomic_write(tmp / "Modelfile", text)
            run_it = "\nRun it: `ollama create NAME -f Modelfile`, then `ollama run NAME`.\n"
            atomic_write(tmp / "README.md", card(source, name, kind, sha, run_it))
            from soup_core.io import umask

            tmp.chmod(0o777 & ~umask())
            if folder.exists():
                folder.rmdir()
            tmp.replace(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _say(f"wrote {folder}: {name}, Modelfile, README.md; ollama create NAME -f {folder / 'Modelfile'}")
