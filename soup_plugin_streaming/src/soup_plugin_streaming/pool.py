"""The buffer pool: ``n`` pre-allocated buffers that decoder layers take turns in, and its schedule.

Layer ``i`` always goes to buffer ``i mod n``; every buffer records which layer it holds. The schedule:

    forward   layer i:   wait(i) -> prefetch(i + 1) -> compute
    backward  layer i:   wait(i) -> prefetch(i - 1) -> recompute, then backward

(the backward pass re-runs each layer's forward under activation checkpointing, from the last layer down,
so the same call serves both; the direction flips the first time a lower layer is asked for after a
higher one). With two or more buffers the buffer being filled is never the one in use. ``wait(i)`` on a
buffer that no longer holds layer ``i`` raises :class:`SchedulerBug` (the tripwire) instead of computing
with another layer's weights.

Device specifics (a copy stream and events on CUDA) live in a transfer object; the CPU one is here.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from soup_plugin_streaming.errors import SchedulerBug
from soup_plugin_streaming.store import LayerStore

MIN_BUFFERS = 2
MAX_BUFFERS = 8


class CpuTransfer:
    """Loads on the CPU: the store copies (RAM) or reads (disk) straight into the buffer."""

    def __init__(self, store: LayerStore, slots: list[dict[str, torch.Tensor]]) -> None:
        self.store, self.slots = store, slots

    def load(self, slot: int, layer: int, keys: list[str]) -> None:
        self.store.fill(layer, {k: self.slots[slot][k] for k in keys})

    def wait(self, slot: int) -> None:
        """Nothing to wait for: a CPU load is finished when ``load`` returns."""


class BufferPool:
    """``buffers`` slots, each holding every tensor a layer may have (the union of the layers' layouts)."""

    def __init__(
        self,
        store: LayerStore,
        buffers: int,
        device: torch.device | str = "cpu",
        transfer: Any = None,
    ) -> None:
        if not MIN_BUFFERS <= buffers <= MAX_BUFFERS:
            # One buffer would be refilled with layer i+1 while layer i still computes from it.
            raise ValueError(f"the buffer pool needs {MIN_BUFFERS} to {MAX_BUFFERS} buffers, got {buffers}")
        self.store = store
        self.n = buffers
        self.device = torch.device(device)
        self.num_layers = store.num_layers
        self.slots: list[dict[str, torch.Tensor]] = [
            {
                key: torch.empty(shape, dtype=dtype, device=self.device)
                for key, (shape, dtype) in store.union.items()
            }
            for _ in range(buffers)
        ]
        self.owner: list[int | None] = [None] * buffers
        self.layer_keys = [list(entries) for entries in store.layer_entries]
        self.transfer = transfer if transfer is not None else CpuTransfer(store, self.slots)
        self.direction = 1
        self.prev: int | None = None
        self.stats = {"loads": 0, "hits": 0, "waits": 0, "load_seconds": 0.0}

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers together."""
        return sum(t.numel() * t.element_size() for slot in self.slots for t in slot.values())

    def slot_of(self, layer: int) -> int:
        return layer % self.n

    def load(self, layer: int) -> None:
        """Make layer ``layer``'s buffer hold it (no copy if it already does)."""
        slot = self.slot_of(layer)
        if self.owner[slot] == layer:
            self.stats["hits"] += 1
            return
        start = time.perf_counter()
        self.owner[slot] = None  # a failed load must not leave the old owner recorded
        self.transfer.load(slot, layer, self.layer_keys[layer])
        self.owner[slot] = layer
        self.stats["loads"] += 1
        self.stats["load_seconds"] += time.perf_counter() - start

    def wait(self, layer: int) -> dict[str, torch.Tensor]:
        """The tensors of layer ``layer``, once its load is complete. The tripwire: raises
        :class:`SchedulerBug` when its buffer holds another layer."""
        slot = self.slot_of(layer)
        if self.owner[slot] != layer:
            held = "nothing" if self.owner[slot] is None else f"layer {self.owner[slot]}"
            raise SchedulerBug(
                f"layer-streaming scheduler bug: buffer {slot} holds {held}, but layer {layer} was "
                "asked for. Computing on would use the wrong weights, so the run stops here. Please "
                f"report this (with training.stream_buffers = {self.n}); raising "
                "training.stream_buffers may work around it."
            )
        self.transfer.wait(slot)
        self.stats["waits"] += 1
        return {key: self.slots[slot][key] for key in self.layer_keys[layer]}

    def prime(self) -> None:
        """Start of a forward pass: the direction is up again and layer 0 is loaded."""
        self.direction = 1
        self.prev = None
        self.load(0)

    def advance(self, layer: int) -> None:
        """After layer ``layer`` got its weights: prefetch the next layer in the current direction."""
        if self.prev is not None and layer < self.prev:
            self.direction = -1  # the backward pass has started recomputing from the top
        self.prev = layer
        nxt = layer + self.direction
        if 0 <= nxt < self.num_layers:
            self.load(nxt)

    def acquire(self, layer: int) -> dict[str, torch.Tensor]:
        """What a layer's forward calls first: wait for its weights, then start the next layer's load."""
        tensors = self.wait(layer)
        self.advance(layer)
        return tensors
