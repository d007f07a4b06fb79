"""The default plugin ``core.tracker``: the recorder that writes each optimizer step's measured metrics to
the experiment tracker (rank 0 only), and the ``soup runs`` command.

The tracker itself (its store and schema) is the core's: :mod:`soup_core.tracker`. Importing this module is
cheap (pluggy and the contracts); the store and the CLI group are imported when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from soup_core.contracts import Command, Recorder
from soup_core.hookspecs import hookimpl

SOUP_HOOK_API = (1, 1)

if TYPE_CHECKING:  # pragma: no cover
    from soup_core.events import OptimizerStep, RunEnd, RunStart
    from soup_core.tracker.store import Tracker


class TrackerRecorder(Recorder):
    """Writes ``OptimizerStep.metrics`` to the tracker row of the run named by ``RunStart.run_id``.

    Only rank 0 writes (other ranks would log the same step again). The tracker is opened on the first
    step, so a run that never steps never touches the database. The run's row is started and ended by
    the caller of the backend (:func:`soup_core.tracker.tracked_run`), not here.
    """

    name: ClassVar[str] = "tracker"
    description: ClassVar[str] = "Writes each optimizer step's metrics to the experiment tracker."
    wants_micro_batches: ClassVar[bool] = False

    def __init__(self) -> None:
        self._run_id: str | None = None
        self._tracker: Tracker | None = None

    def on_run_start(self, event: RunStart) -> None:
        if event.rank == 0:
            self._run_id = event.run_id

    def on_optimizer_step(self, event: OptimizerStep) -> None:
        if event.rank != 0 or self._run_id is None:
            return
        if self._tracker is None:
            from soup_core.tracker.store import Tracker

            self._tracker = Tracker()
        self._tracker.log_metrics(self._run_id, event.step, event.metrics)

    def on_run_end(self, event: RunEnd) -> None:
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None


@hookimpl
def soup_register_recorders() -> list[type[Any]]:
    return [TrackerRecorder]


@hookimpl
def soup_register_commands() -> list[Command]:
    from soup_core.default_plugins.commands.runs import runs_app

    return [Command(name="runs", target=runs_app, help="List, show and delete tracked runs.")]
