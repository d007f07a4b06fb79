"""NF4 for streamed layers: quantise once when the store is split, dequantise inside the checkpointed region.

A quantised weight ``W`` (out x in) is stored as up to four tensors under its name:

- ``W`` itself: the packed 4-bit codes (uint8, two per byte),
- ``W::absmax``: one scale per block of 64 values (float32, or uint8 codes with double quantisation),
- ``W::nested_absmax`` and ``W::offset`` (double quantisation only): the float32 scales of those codes
  (one per 256 blocks) and the mean that was subtracted before quantising them.

The two code tables (16 NF4 levels; 256 levels for the nested scales) are the same for every weight; they
are stored once, in the extras file, and held resident.

At run time a weight is rebuilt with bitsandbytes' ``dequantize_4bit`` over views of the pooled buffer
and multiplied with a plain ``F.linear``. It never goes through bitsandbytes' ``MatMul4Bit``, which keeps
the packed weight on its autograd context outside ``save_for_backward``: activation checkpointing cannot
see such a reference, so it would outlive the checkpoint boundary and read a buffer that has since been
refilled with another layer (silently wrong gradients). Here the dense weight is an ordinary saved tensor
of ``F.linear`` inside the checkpointed region, discarded after the forward and recomputed for the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
CODE_KEY = "__soup_nf4__.code"
NESTED_CODE_KEY = "__soup_nf4__.nested_code"
SUFFIXES = ("::absmax", "::nested_absmax", "::offset")


@dataclass(frozen=True)
class QuantSpec:
    """What is needed to dequantise one stored weight besides its tensors."""

    shape: tuple[int, ...]
    dtype: torch.dtype  # the dense dtype it was quantised from and dequantises to
    nested: bool
    blocksize: int = BLOCKSIZE

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "nested": self.nested,
            "blocksize": self.blocksize,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> QuantSpec:
        dtype = getattr(torch, str(data["dtype"]), None)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"NF4 spec has dtype {data['dtype']!r}, not a float type")
        shape = tuple(int(d) for d in data["shape"])
        if len(shape) != 2 or min(shape) < 1:
            raise ValueError(f"NF4 spec has shape {list(shape)}, not a 2-D weight")
        blocksize = int(data.get("blocksize", BLOCKSIZE))
        if blocksize != BLOCKSIZE:
            raise ValueError(f"NF4 spec has blocksize {blocksize}; this store format uses {BLOCKSIZE}")
        return cls(shape=shape, dtype=dtype, nested=bool(data["nested"]), blocksize=blocksize)


def quantize(
    weight: torch.Tensor, *, nested: bool, device: str | torch.device = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], QuantSpec]:
    """Quantise a dense 2-D weight to NF4 on ``device``.

    Returns (the tensors to store under the weight's name, keyed by suffix ``""``, ``::absmax``, ...,
    on the CPU), (the two code tables), and the spec.
    """
    import bitsandbytes.functional as bnbf

    spec = QuantSpec(shape=tuple(weight.shape), dtype=weight.dtype, nested=nested)
    packed, state = bnbf.quantize_4bit(
        weight.to(device), blocksize=BLOCKSIZE, compress_statistics=nested, quant_type="nf4"
    )
    tensors = {"": packed, "::absmax": state.absmax}
    codes = {CODE_KEY: state.code}
    if nested:
        tensors["::nested_absmax"] = state.state2.absmax
        tensors["::offset"] = state.offset.reshape(())
        codes[NESTED_CODE_KEY] = state.state2.code
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return cpu, {k: v.detach().to("cpu").contiguous() for k, v in codes.items()}, spec


def check_sizes(name: str, spec: QuantSpec, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a stored weight whose tensors cannot hold what its spec claims (a trust boundary: the
    native dequantiser would read out of bounds otherwise)."""
    numel = spec.shape[0] * spec.shape[1]
    blocks = -(-numel // spec.blocksize)
    packed = tensors.get("")
    absmax = tensors.get("::absmax")
    problems = []
    if packed is None or packed.dtype != torch.uint8 or packed.numel() * 2 < numel:
        problems.append("packed codes")
    if absmax is None or absmax.numel() < blocks:
        problems.append("block scales")
    if spec.nested:
        nested = tensors.get("::nested_absmax")
        offset = tensors.get("::offset")
        if absmax is not None and absmax.dtype != torch.uint8:
            problems.append("nested block codes")
        if (
            nested is None
            or nested.numel() < -(-blocks // NESTED_BLOCKSIZE)
            or offset is None
            or offset.numel() != 1
        ):
            problems.append("nested scales")
    elif absmax is not None and absmax.dtype != torch.float32:
        problems.append("block scales dtype")
    if problems:
        raise ValueError(f"NF4 weight {name!r} ({list(spec.shape)}): its {', '.join(problems)} do not match")


def dequantize(
    spec: QuantSpec, tensors: dict[str, torch.Tensor], codes: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The dense weight (``spec.dtype``) rebuilt from stored tensors (views of a pooled buffer are fine:
    nothing here writes to them)."""
    import bitsandbytes.functional as bnbf

    state2 = None
    offset = None
    if spec.nested:
        state2 = bnbf.QuantState(
            absmax=tensors["::nested_absmax"],
            code=codes[NESTED_CODE_KEY],
            blocksize=NESTED_BLOCKSIZE,
            dtype=torch.float32,
        )
        offset = tensors["::offset"]
    state = bnbf.QuantState(
        absmax=tensors["::absmax"],
        shape=torch.Size(spec.shape),
        code=codes[CODE_KEY],
        blocksize=spec.blocksize,
        quant_type="nf4",
        dtype=spec.dtype,
        offset=offset,
        state2=state2,
    )
    return bnbf.dequantize_4bit(tensors[""], state)


def roundtrip(weight: torch.Tensor, *, nested: bool, device: str | torch.device = "cpu") -> torch.Tensor:
    """``dequantize(quantize(weight))`` on ``device``: what a streamed NF4 layer computes with. Used to
    build resident references with the same numerics."""
    tensors, codes, spec = quantize(weight, nested=nested, device=device)
    on = {k: v.to(device) for k, v in tensors.items()}
    return dequantize(spec, on, {k: v.to(device) for k, v in codes.items()}).to(weight.device)


def nf4_linear_forward(module: Any, x: torch.Tensor) -> torch.Tensor:
    """The forward of a streamed NF4 linear: dequantise the current layer's weight, then ``F.linear``.

    ``module._soup_nf4`` is set by the layer's substitution for the duration of one layer call; outside a
    call it is None and using the module is a bug.
    """
    bound = module._soup_nf4
    if bound is None:
        raise RuntimeError(
            f"streamed NF4 linear {module._soup_name!r} was called outside its layer's forward"
        )
    spec, tensors, codes = bound
    # Exactly what nn.Linear does with a dense weight of the same dtype, so a resident model whose weights
    # went through the same round trip computes the same bits.
    return torch.nn.functional.linear(x, dequantize(spec, tensors, codes), module.bias)
