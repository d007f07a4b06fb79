"""The layer store: a base checkpoint split once into one file per decoder layer plus the resident extras.

Layout of a store folder (``$SOUP_HOME/streaming/<name>-<fingerprint>``)::

    index.json               written last: a folder without it is incomplete and is rebuilt
    layer_000.safetensors    decoder layer 0, keys relative to the layer (``self_attn.q_proj.weight``)
    ...
    extras.safetensors       embeddings, final norm, untied head, and the NF4 code tables if quantised

The fingerprint covers the source files (name, size, modification time), the model's ``config.json``, the
dtype and the quantisation settings, so any change gives a new store. Splitting reads one tensor at a time
and holds at most one layer (plus the extras), never the whole model.

Two ways to serve layers: :class:`RamStore` (every layer in host memory, pinned on CUDA when asked) and
:class:`DiskStore` (each layer read from its file on demand, straight into the caller's buffer).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from soup_plugin_streaming import nf4
from soup_plugin_streaming.errors import StreamingError
from soup_plugin_streaming.tensorfile import TensorEntry, read_header, read_into, read_tensor, write_file

STORE_FORMAT = 1
INDEX = "index.json"
EXTRAS = "extras.safetensors"
#: RAM is chosen by ``stream_source: auto`` when the store takes less than this share of available memory.
RAM_SHARE = 0.7

Report = Callable[[str], None]


@dataclass(frozen=True)
class SplitSettings:
    """What the stored bytes depend on besides the source files."""

    dtype: torch.dtype
    quant: str = "none"  # "none" or "nf4"
    double_quant: bool = True
    quant_device: str = "cpu"  # where NF4 is quantised: CPU and CUDA differ in the nested statistics
    quantize_keys: frozenset[str] = frozenset()  # layer-relative weight names quantised under NF4
    layer_prefix: str = "model.layers"

    def to_json(self) -> dict[str, Any]:
        quantised = self.quant == "nf4"
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "quant": self.quant,
            "double_quant": self.double_quant if quantised else None,
            "quant_device": self.quant_device if quantised else None,
            "quantize_keys": sorted(self.quantize_keys) if quantised else [],
            "layer_prefix": self.layer_prefix,
        }


# ------------------------------------------------------------------------------------------ sources


def source_files(source: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint in ``source`` -> the safetensors file that holds it."""
    index = source / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise StreamingError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = {str(k): source / str(v) for k, v in weight_map.items()}
    elif (source / "model.safetensors").is_file():
        files = {}
        for name in read_header(source / "model.safetensors")[0]:
            files[name] = source / "model.safetensors"
    else:
        other = sorted(p.name for p in source.glob("*.bin")) if source.is_dir() else []
        hint = (
            f" (it has {', '.join(other[:3])}: convert the checkpoint to safetensors, e.g. load it with "
            "transformers and save_pretrained it again)"
            if other
            else ""
        )
        raise StreamingError(
            f"base: {source} holds no safetensors checkpoint, which layer streaming reads{hint}"
        )
    for path in set(files.values()):
        if not path.is_file():
            raise StreamingError(f"base: checkpoint file {path} is listed but missing")
        if path.is_symlink() and not path.resolve().is_file():
            raise StreamingError(f"base: checkpoint file {path} is a broken link")
    return files


def fingerprint(source: Path, settings: SplitSettings) -> str:
    """A digest of the source files (name, size, modification time), ``config.json`` and ``settings``."""
    files = sorted(set(source_files(source).values()))
    facts: dict[str, Any] = {"format": STORE_FORMAT, "settings": settings.to_json(), "files": []}
    for path in files:
        stat = path.stat()
        facts["files"].append([path.name, stat.st_size, stat.st_mtime_ns])
    config = source / "config.json"
    facts["config"] = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def default_root() -> Path:
    """``$SOUP_HOME/streaming`` (``~/.soup/streaming``)."""
    from soup_core import soup_home

    return Path(soup_home()) / "streaming"


def _slug(source: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "_", source.name or "model").strip("._") or "model"
    return name[:64]


# ------------------------------------------------------------------------------------------ splitting


def _classify(names: list[str], prefix: str, num_layers: int) -> tuple[list[dict[str, str]], list[str]]:
    """(for each layer: checkpoint name -> name inside the layer), the names of everything else."""
    layers: list[dict[str, str]] = [{} for _ in range(num_layers)]
    extras: list[str] = []
    pattern = re.compile(re.escape(prefix) + r"\.(?P<index>\d+)\.(?P<rest>.+)")
    for name in names:
        match = pattern.fullmatch(name)
        if match:
            index = int(match["index"])
            if index >= num_layers:
                raise StreamingError(
                    f"checkpoint tensor {name!r} belongs to layer {index}, "
                    f"but the model config has {num_layers}"
                )
            layers[index][name] = match["rest"]
        else:
            extras.append(name)
    empty = [i for i, keys in enumerate(layers) if not keys]
    if empty:
        raise StreamingError(
            f"the checkpoint has no weights for decoder layer(s) {empty[:5]} under {prefix!r}"
        )
    return layers, extras


def _convert(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor


def split_checkpoint(
    source: Path, dest: Path, settings: SplitSettings, num_layers: int, fp: str
) -> dict[str, Any]:
    """Write the store for ``source`` into the (empty) folder ``dest``; returns its index.

    Reads one source tensor at a time and writes each layer as soon as it is complete.
    """
    files = source_files(source)
    headers: dict[Path, dict[str, TensorEntry]] = {p: read_header(p)[0] for p in set(files.values())}
    layer_keys, extra_keys = _classify(list(files), settings.layer_prefix, num_layers)
    quantised = settings.quant == "nf4"
    width = max(3, len(str(num_layers - 1)))
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    specs: dict[str, dict[str, Any]] = {}
    codes: dict[str, torch.Tensor] = {}
    layer_files: list[str] = []
    layer_bytes: list[int] = []
    handles: dict[Path, Any] = {}

    def read(name: str) -> torch.Tensor:
        path = files[name]
        if path not in handles:
            handles[path] = open(path, "rb")  # noqa: SIM115 - closed in the finally below
        return read_tensor(handles[path], headers[path][name])

    def in_file_order(names: list[str]) -> list[str]:
        return sorted(names, key=lambda n: (str(files[n]), headers[files[n]][n].start))

    try:
        for index, keys in enumerate(layer_keys):
            out: list[tuple[str, torch.Tensor]] = []
            for name in in_file_order(list(keys)):
                rest = keys[name]
                tensor = _convert(read(name), settings.dtype)
                if quantised and rest in settings.quantize_keys:
                    parts, tables, spec = nf4.quantize(
                        tensor, nested=settings.double_quant, device=settings.quant_device
                    )
                    for key, table in tables.items():
                        if key not in codes:
                            codes[key] = table
                        elif not torch.equal(codes[key], table):
                            raise StreamingError(
                                f"bitsandbytes returned a different NF4 code table for {name!r}"
                            )
                    _same_everywhere(specs, rest, spec.to_json(), name)
                    out += [(rest + suffix, part) for suffix, part in parts.items()]
                else:
                    out.append((rest, tensor))
            for key, tensor in out:
                _same_everywhere(shapes, key, (tuple(tensor.shape), tensor.dtype), f"layer {index}: {key}")
            filename = f"layer_{index:0{width}d}.safetensors"
            layer_bytes.append(write_file(dest / filename, out, {"soup_streaming_layer": str(index)}))
            layer_files.append(filename)
            del out
        extras = [(name, _convert(read(name), settings.dtype)) for name in in_file_order(extra_keys)]
        extras += sorted(codes.items())
        extras_bytes = write_file(dest / EXTRAS, extras, {"soup_streaming": "extras"})
    finally:
        for handle in handles.values():
            handle.close()
    index_data = {
        "format": STORE_FORMAT,
        "fingerprint": fp,
        "source": str(source),
        "settings": settings.to_json(),
        "num_layers": num_layers,
        "layer_prefix": settings.layer_prefix,
        "layers": layer_files,
        "extras": EXTRAS,
        "quantized": specs,
        "layer_bytes": max(layer_bytes),
        "store_bytes": sum(layer_bytes),
        "extras_bytes": extras_bytes,
    }
    (dest / INDEX).write_text(json.dumps(index_data, indent=1), encoding="utf-8")
    return index_data


def _same_everywhere(seen: dict[str, Any], key: str, value: Any, where: str) -> None:
    if key in seen and seen[key] != value:
        raise StreamingError(f"{where} has {value}, but another layer has {seen[key]}; layers must agree")
    seen.setdefault(key, value)


def _valid_index(folder: Path, fp: str) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != STORE_FORMAT or data.get("fingerprint") != fp:
        return None
    names = [*data.get("layers", []), data.get("extras", "")]
    if (
        not names[-1]
        or len(names) - 1 != data.get("num_layers")
        or not all((folder / n).is_file() for n in names)
    ):
        return None
    return data


def ensure_store(
    source: Path,
    settings: SplitSettings,
    num_layers: int,
    *,
    root: Path | None = None,
    report: Report = print,
) -> Path:
    """The folder of the store for ``source`` with ``settings``, split now if it is missing, incomplete or
    stale. Concurrent callers each build privately; the first to rename wins and the others use it."""
    fp = fingerprint(source, settings)
    root = Path(root) if root is not None else default_root()
    target = root / f"{_slug(source)}-{fp[:20]}"
    if _valid_index(target, fp) is not None:
        report(f"layer store: reusing {target}")
        return target
    root.mkdir(parents=True, exist_ok=True)
    if target.exists():  # incomplete or corrupt: rebuild it
        shutil.rmtree(target, ignore_errors=True)
    report(f"layer store: splitting {source} into {num_layers} layer files at {target} (once)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        split_checkpoint(source, tmp, settings, num_layers, fp)
        try:
            os.replace(tmp, target)
        except OSError:
            if _valid_index(target, fp) is None:
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# -------------------------------------------------------------------------------------------- serving


@dataclass
class LayerStore:
    """An opened store: its index, each layer's tensor layout, and the union layout one buffer must hold."""

    path: Path
    index: dict[str, Any]
    layer_entries: list[dict[str, TensorEntry]]
    union: dict[str, tuple[tuple[int, ...], torch.dtype]]
    quant_specs: dict[str, nf4.QuantSpec]
    tier: str = ""
    stats: dict[str, float] = field(default_factory=lambda: {"reads": 0, "bytes": 0})
    #: how host tensors that feed a GPU are allocated (pinned or not); None off CUDA
    host_allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None

    @classmethod
    def open_layout(cls, path: Path) -> dict[str, Any]:
        """Read and check a store folder; returns the fields shared by both tiers."""
        try:
            index = json.loads((path / INDEX).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StreamingError(
                f"layer store {path} is unreadable ({exc}); delete the folder to rebuild it"
            ) from exc
        entries = [read_header(path / name)[0] for name in index["layers"]]
        union: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for layer, layer_entries in enumerate(entries):
            for key, entry in layer_entries.items():
                _same_everywhere(union, key, (entry.shape, entry.dtype), f"{path}: layer {layer}: {key}")
        specs = {}
        for key, data in index.get("quantized", {}).items():
            try:
                specs[key] = nf4.QuantSpec.from_json(data)
            except (KeyError, TypeError, ValueError) as exc:
                raise StreamingError(f"layer store {path}: bad NF4 spec for {key!r} ({exc})") from exc
            for layer, layer_entries in enumerate(entries):
                if key in layer_entries:
                    parts = {
                        s: layer_entries[key + s] for s in ("", *nf4.SUFFIXES) if key + s in layer_entries
                    }
                    fake = {s: torch.empty(e.shape, dtype=e.dtype, device="meta") for s, e in parts.items()}
                    try:
                        nf4.check_sizes(f"layer {layer}: {key}", specs[key], fake)
                    except ValueError as exc:
                        raise StreamingError(f"layer store {path}: {exc}") from exc
        return {"path": path, "index": index, "layer_entries": entries, "union": union, "quant_specs": specs}

    @property
    def num_layers(self) -> int:
        return len(self.layer_entries)

    @property
    def layer_bytes(self) -> int:
        """Bytes one buffer needs (the union of every layer's tensors)."""
        return sum(_numel(shape) * dtype.itemsize for shape, dtype in self.union.values())

    @property
    def store_bytes(self) -> int:
        return int(self.index["store_bytes"])

    def extras(self) -> dict[str, torch.Tensor]:
        """Every extras tensor (embeddings, norms, head, code tables), read into new CPU tensors."""
        path = self.path / self.index["extras"]
        entries = read_header(path)[0]
        with open(path, "rb") as handle:
            return {name: read_tensor(handle, entry) for name, entry in entries.items()}

    def host(self, layer: int) -> dict[str, torch.Tensor] | None:
        """The layer's tensors held in host memory (RAM tier), or None (disk tier)."""
        return None

    def fill(self, layer: int, out: dict[str, torch.Tensor]) -> None:
        """Copy layer ``layer``'s tensors into the CPU tensors ``out`` (keyed like the layer file)."""
        raise NotImplementedError


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


class RamStore(LayerStore):
    """Every layer in host memory. ``allocate(shape, dtype)`` makes each host tensor (pinned on CUDA);
    each is filled straight from its file, one tensor at a time."""

    tensors: list[dict[str, torch.Tensor]]

    @classmethod
    def open(
        cls, path: Path, allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None
    ) -> RamStore:
        store = cls(**cls.open_layout(path), tier="ram")
        allocate = allocate or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        store.tensors = []
        for name, entries in zip(store.index["layers"], store.layer_entries, strict=True):
            with open(path / name, "rb") as handle:
                store.tensors.append(
                    {k: read_into(handle, e, allocate(e.shape, e.dtype)) for k, e in entries.items()}
                )
        return store

    def host(self, layer: int) -> dict[str, torch.Tensor]:
        return self.tensors[layer]

    def fill(self, layer: int, out: dict[str, torch.Tensor]) -> None:
        for key, tensor in self.tensors[layer].items():
            out[key].copy_(tensor)
        self.stats["reads"] += 1


class DiskStore(LayerStore):
    """Layers read from their files on demand, into the caller's buffer (no intermediate copy)."""

    @classmethod
    def open(cls, path: Path) -> DiskStore:
        return cls(**cls.open_layout(path), tier="disk")

    def fill(self, layer: int, out: dict[str, torch.Tensor]) -> None:
        entries = self.layer_entries[layer]
        with open(self.path / self.index["layers"][layer], "rb", buffering=0) as handle:
            for key, entry in entries.items():
                read_into(handle, entry, out[key])
        self.stats["reads"] += 1
        self.stats["bytes"] += sum(e.nbytes for e in entries.values())


# ------------------------------------------------------------------------------------------------ tiers


def available_memory() -> int:
    """Bytes of host memory available to this process now (psutil's "available")."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil comes with accelerate
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise StreamingError(  # noqa: B904 - no psutil is not the problem to report
            "cannot tell how much memory is available; set training.stream_source: ram or disk"
        )


def choose_tier(requested: str, store_bytes: int, available: int | None = None) -> tuple[str, str]:
    """(tier, why). ``auto`` picks RAM when the store takes under 70% of available memory, else disk."""
    if requested in ("ram", "disk"):
        return requested, f"training.stream_source: {requested}"
    if requested != "auto":
        raise StreamingError(f"training.stream_source must be auto, ram or disk; got {requested!r}")
    available = available_memory() if available is None else available
    share = f"{store_bytes / 2**20:,.1f} MiB store vs {available / 2**20:,.0f} MiB available"
    if store_bytes < RAM_SHARE * available:
        return "ram", f"auto: it fits in memory with a margin ({share})"
    return "disk", f"auto: it does not fit in {RAM_SHARE:.0%} of available memory ({share})"
