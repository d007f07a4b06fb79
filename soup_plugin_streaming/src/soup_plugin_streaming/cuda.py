"""Everything CUDA-specific about streaming: pinned host memory, the copy stream, the per-buffer events.

A load into buffer ``s`` runs on a side stream that first waits for the compute stream (so the layer that
last used ``s`` has finished with it), copies, and records event ``s``; ``wait`` makes the compute stream
wait for event ``s``. From the disk tier the bytes go file -> a pinned staging buffer (one per pool buffer)
-> device; a staging buffer is refilled only after its previous copy has completed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from soup_plugin_streaming.errors import StreamingError
from soup_plugin_streaming.store import LayerStore

Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def host_allocator(
    pin: bool | str, report: Callable[[str], None], *, what: str
) -> tuple[Allocate, list[str]]:
    """An allocator for host tensors that feed the GPU, and a list that says afterwards whether it pinned.

    ``pin``: True (pinned, refuse if the system will not pin), False (pageable), "auto" (pinned, else
    pageable with a notice: copies from pageable memory cannot overlap with compute).
    """
    outcome: list[str] = []

    def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if pin is False or (outcome and outcome[0] == "pageable"):
            outcome[:] = ["pageable"]
            return torch.empty(shape, dtype=dtype)
        try:
            tensor = torch.empty(shape, dtype=dtype, pin_memory=True)
        except (RuntimeError, MemoryError) as exc:
            if pin is True:
                raise StreamingError(
                    f"training.stream_pin: true, but the system refused to pin the {what} ({exc}); "
                    "free memory, or set training.stream_pin: auto or false"
                ) from exc
            report(
                f"stream_pin auto: could not pin the {what} ({type(exc).__name__}); using pageable memory, "
                "so layer copies will not overlap with compute"
            )
            outcome[:] = ["pageable"]
            return torch.empty(shape, dtype=dtype)
        outcome[:] = ["pinned"]
        return tensor

    return allocate, outcome


class CudaTransfer:
    """Asynchronous loads into the pool's device buffers on a side stream."""

    def __init__(
        self,
        store: LayerStore,
        slots: list[dict[str, torch.Tensor]],
        device: torch.device,
        allocate: Allocate | None = None,
    ) -> None:
        self.store, self.slots, self.device = store, slots, device
        self.stream = torch.cuda.Stream(device=device)
        self.events = [torch.cuda.Event() for _ in slots]
        self.staging: list[dict[str, torch.Tensor]] | None = None
        #: set to a list to measure (benchmarks): each wait appends (event before, event after) on the
        #: compute stream, whose elapsed time is how long the compute stream stood waiting for a copy
        self.wait_timing: list[tuple[Any, Any]] | None = None
        if store.host(0) is None:  # disk tier: bytes need a host landing place per buffer
            allocate = allocate or (lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True))
            self.staging = [
                {key: allocate(shape, dtype) for key, (shape, dtype) in store.union.items()} for _ in slots
            ]

    def load(self, slot: int, layer: int, keys: list[str]) -> None:
        source: dict[str, torch.Tensor] | None = self.store.host(layer)
        if source is None:
            assert self.staging is not None
            self.events[slot].synchronize()  # the last copy out of this staging buffer is done
            source = {key: self.staging[slot][key] for key in keys}
            self.store.fill(layer, source)
        else:
            self.store.stats["reads"] += 1
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for key in keys:
                self.slots[slot][key].copy_(source[key], non_blocking=True)
            self.events[slot].record(self.stream)

    def wait(self, slot: int) -> None:
        stream = torch.cuda.current_stream(self.device)
        if self.wait_timing is None:
            stream.wait_event(self.events[slot])
            return
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(self.events[slot])
        after.record(stream)
        self.wait_timing.append((before, after))


def transfer_factory(
    device: torch.device, allocate: Allocate | None
) -> Callable[[LayerStore, list[dict[str, torch.Tensor]]], Any]:
    """What :func:`soup_plugin_streaming.runtime.build_streamed_model` takes to load on ``device``."""
    return lambda store, slots: CudaTransfer(store, slots, device, allocate)
