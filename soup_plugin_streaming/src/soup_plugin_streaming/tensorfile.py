"""Reading and writing safetensors files one tensor at a time.

The format is small (an 8-byte little-endian header length, a JSON header, then the raw bytes), so it is
read here with plain ``readinto`` straight into a tensor the caller already owns: no memory map whose pages
would count against the process, no intermediate copy. Files written here are ordinary safetensors files
that ``safetensors.safe_open`` reads too (a test checks it).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from soup_plugin_streaming.errors import StreamingError

#: safetensors dtype codes <-> torch dtypes (the subset a causal LM checkpoint holds)
_CODES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: code for code, dtype in _CODES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
_CHUNK = 64 * 1024 * 1024  # read in slices so one huge tensor is not one huge syscall


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a file: dtype, shape, and its absolute byte range."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n


def _check_host() -> None:
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        raise StreamingError(
            "layer streaming needs a little-endian machine (safetensors stores little-endian)"
        )


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors of a safetensors file (name -> entry, in file order) and its ``__metadata__``.

    The header is a trust boundary: sizes, dtypes and byte ranges are checked against the file.
    """
    _check_host()
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise StreamingError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER, size - 8):
            raise StreamingError(f"{path}: not a safetensors file (header length {length} is impossible)")
        try:
            header = json.loads(handle.read(length))
        except ValueError as exc:
            raise StreamingError(f"{path}: the safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise StreamingError(f"{path}: the safetensors header is not a mapping")
    base = 8 + length
    metadata = header.pop("__metadata__", None) or {}
    entries: dict[str, TensorEntry] = {}
    for name, spec in header.items():
        try:
            dtype = _CODES[spec["dtype"]]
            shape = tuple(int(d) for d in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StreamingError(f"{path}: tensor {name!r} has an unreadable header entry {spec!r}") from exc
        entry = TensorEntry(dtype, shape, base + begin, base + end)
        if any(d < 0 for d in shape) or not (base <= entry.start <= entry.end <= size):
            raise StreamingError(f"{path}: tensor {name!r} lies outside the file")
        if entry.numel * dtype.itemsize != entry.nbytes:
            raise StreamingError(
                f"{path}: tensor {name!r} claims {entry.nbytes} bytes for shape {list(shape)}"
            )
        entries[name] = entry
    return dict(sorted(entries.items(), key=lambda item: item[1].start)), dict(metadata)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage."""
    flat = tensor.reshape(-1)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        raise ValueError("the destination tensor must be contiguous")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def read_into(handle: BinaryIO, entry: TensorEntry, out: torch.Tensor) -> torch.Tensor:
    """Fill the contiguous CPU tensor ``out`` (same dtype and element count as ``entry``) from ``handle``."""
    if out.dtype != entry.dtype or out.numel() != entry.numel or out.device.type != "cpu":
        raise ValueError(
            f"read_into: destination {out.dtype}{list(out.shape)} on {out.device} does not match "
            f"{entry.dtype}{list(entry.shape)}"
        )
    if entry.nbytes == 0:
        return out
    view = _bytes_of(out)
    handle.seek(entry.start)
    done = 0
    while done < entry.nbytes:
        n = handle.readinto(view[done : min(done + _CHUNK, entry.nbytes)])
        if not n:
            raise StreamingError(
                f"{getattr(handle, 'name', 'file')}: ended inside a tensor (truncated file?)"
            )
        done += n
    return out


def read_tensor(handle: BinaryIO, entry: TensorEntry) -> torch.Tensor:
    """A new CPU tensor holding ``entry``."""
    return read_into(handle, entry, torch.empty(entry.shape, dtype=entry.dtype))


def write_file(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write CPU tensors to a safetensors file (in the order given); returns the bytes of tensor data.

    Each tensor's bytes are written from its own memory: nothing is copied except a non-contiguous tensor.
    """
    _check_host()
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, tensor in items:
        if tensor.dtype not in _NAMES:
            raise ValueError(f"write_file: {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        if tensor.device.type != "cpu":
            raise ValueError(f"write_file: {name!r} is on {tensor.device}; move it to the CPU first")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)))
        handle.write(blob)
        for _, tensor in items:
            if tensor.numel():
                handle.write(_bytes_of(tensor.contiguous()))
        handle.flush()
        os.fsync(handle.fileno())
    return offset
