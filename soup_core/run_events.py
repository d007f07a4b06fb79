"""Fans a run's events out to its recorders (guarded) and controllers (loud).

A backend holds one :class:`RunEvents` per run and calls it; it never talks to recorders directly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from soup_core.contracts import Controller, ControllerAction, ExcludeRows, Recorder
from soup_core.events import MicroBatch, OptimizerStep, PendingUpdate, RunEnd, RunStart


class ControllerError(RuntimeError):
    """A controller raised: the run stops, naming the plugin."""


@dataclass
class _Observer:
    recorder: Recorder
    plugin: str
    enabled: bool = True


def _default_report(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class RunEvents:
    """The per-run event fan-out. ``recorders``/``controllers`` are (instance, plugin name) pairs."""

    recorders: list[tuple[Recorder, str]] = field(default_factory=list)
    controllers: list[tuple[Controller, str]] = field(default_factory=list)
    report: Callable[[str], None] = _default_report
    trace: bool = field(default_factory=lambda: os.environ.get("SOUP_TRACE_HOOKS") == "1")

    def __post_init__(self) -> None:
        self._observers = [_Observer(rec, plugin) for rec, plugin in self.recorders]

    @property
    def has_recorders(self) -> bool:
        """True while at least one enabled recorder wants micro-batch events; when False, a backend may
        skip computing per-row statistics (the tracker's recorder, which reads only step metrics, does
        not count)."""
        return any(obs.enabled and getattr(obs.recorder, "wants_micro_batches", True) for obs in self._observers)

    def _fan_out(self, method: str, event: Any, *, only_wanting: bool = False) -> None:
        for obs in self._observers:
            if not obs.enabled or (only_wanting and not getattr(obs.recorder, "wants_micro_batches", True)):
                continue
            if self.trace:
                self.report(f"[hook] {obs.plugin}:{type(obs.recorder).__name__}.{method}")
            try:
                getattr(obs.recorder, method)(event)
            except Exception as exc:  # noqa: BLE001 - observers must never break training
                obs.enabled = False
                self.report(
                    f"Recorder {obs.recorder.name!r} from plugin {obs.plugin!r} disabled: "
                    f"{type(exc).__name__}: {exc}"
                )

    def run_start(self, event: RunStart) -> None:
        self._fan_out("on_run_start", event)
        self.start_exclusions: list[int] = []  # rows a controller excludes from the first step (a resume)
        for controller, plugin in self.controllers:
            result = self._call_controller(controller, plugin, "on_run_start", event)
            self.start_exclusions += [r for a in (result or ()) if isinstance(a, ExcludeRows) for r in a.rows]

    def micro_batch(self, event: MicroBatch) -> None:
        self._fan_out("on_micro_batch", event, only_wanting=True)

    def optimizer_step(self, event: OptimizerStep) -> list[ControllerAction]:
        """Report a finished step; returns the controllers' actions, in controller order."""
        self._fan_out("on_optimizer_step", event)
        actions: list[ControllerAction] = []
        for controller, plugin in self.controllers:
            result: Sequence[ControllerAction] | None = self._call_controller(
                controller, plugin, "on_step", event
            )
            actions.extend(result or ())
        return actions

    @property
    def wants_rows(self) -> bool:
        """True when a controller reads the step's rows before an update."""
        return any(getattr(c, "wants_rows", False) for c, _ in self.controllers)

    def pending_update(self, event: PendingUpdate) -> list[ControllerAction]:
        """Ask the controllers about an update before it is applied; their actions, in controller order."""
        actions: list[ControllerAction] = []
        for controller, plugin in self.controllers:
            if getattr(type(controller), "before_update", Controller.before_update) is not Controller.before_update:
                actions.extend(self._call_controller(controller, plugin, "before_update", event) or ())
        return actions

    def run_end(self, event: RunEnd) -> None:
        self._fan_out("on_run_end", event)

    def _call_controller(self, controller: Controller, plugin: str, method: str, event: Any) -> Any:
        if self.trace:
            self.report(f"[hook] {plugin}:{type(controller).__name__}.{method}")
        try:
            return getattr(controller, method)(event)
        except Exception as exc:
            raise ControllerError(
                f"controller {controller.name!r} from plugin {plugin!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
