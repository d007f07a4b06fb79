"""What a plugin registers: backends, tasks, data formats, recorders, controllers, commands, config fields,
probes and support-table entries (docs/plugins.md, "What a plugin can register").

Import-light: ``soup --help`` imports this module; heavy work belongs inside methods. Immutable records are
``NamedTuple`` rather than frozen dataclasses: their classes cost a sixth as much to create, at every start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from soup_core.events import MicroBatch, OptimizerStep, PendingUpdate, RunEnd, RunStart


# --------------------------------------------------------------------------------------------- probes


class ProbeResult(NamedTuple):
    ok: bool
    reason: str = ""  # why it failed (empty when ok)
    fix: str = ""  # the command or change that fixes it
    detail: str = ""  # extra facts shown when ok (e.g. "device: cpu")


class Probe(NamedTuple):
    """A capability check. ``deep=False`` probes run at every load and must not import heavy libraries
    (use :mod:`soup_core.probes` helpers); ``deep=True`` probes may import and construct the real object,
    and run before a run that uses the plugin and under ``soup plugins list --check``.

    ``scope`` names the backend or task the probe gates (``"task:ppo"``, ``"backend:mlx"``); ``None``
    gates the whole plugin.
    """

    name: str
    check: Callable[[], ProbeResult]
    deep: bool = False
    scope: str | None = None


# --------------------------------------------------------------------------------------- config fields


class ConfigField(NamedTuple):
    """A config field a plugin adds, by full dotted path (``training.rewind_log``, ``data.forget``).

    ``annotation`` is a type pydantic understands, or ``"module:attr"`` naming one: imported only when a
    config is validated, so a type built with pydantic costs nothing at start-up. ``default`` is used
    when the key is absent (use ``REQUIRED`` for a field the user must set). ``observer=True`` marks a
    switch for a recorder: it is never refused by the support table.
    """

    path: str
    annotation: Any
    default: Any = None
    description: str = ""
    observer: bool = False


REQUIRED: Any = ...  # marker: a ConfigField with this default must be given


class Support(NamedTuple):
    """One row of the support table: the ``fields`` the (``backend``, ``task``) pair honours.

    Rows for the same pair from several plugins are merged. A field set to a non-default value that the
    chosen pair does not honour is refused at config time.

    A row with ``task="*"`` and a ``capability`` adds its fields to every task of ``backend`` whose class
    declares that capability and that has a row of its own (the streaming plugin's fields go to every
    ``streamable`` task on transformers, a third party's included). It never makes a pair supported.
    """

    backend: str
    task: str
    fields: frozenset[str]
    capability: str = ""
    #: why the pair leaves a field out (path -> reason), shown when a config sets that field
    reasons: Mapping[str, str] | None = None


# ------------------------------------------------------------------------------------------ data formats


class DataFormat(NamedTuple):
    """A row format: how to recognise a raw record and turn it into a training example.

    ``to_example`` returns the normalised example (a JSON-serialisable dict) or raises ``ValueError``
    with a message saying what is wrong with the record. ``detect`` answers whether a record looks like
    this format (used by ``data.format: auto``). Pure Python: runs without torch.
    """

    name: str
    keys: tuple[str, ...]  # the keys that identify it, shown in messages
    detect: Callable[[Mapping[str, Any]], bool]
    to_example: Callable[[Mapping[str, Any]], dict[str, Any]]
    description: str = ""
    priority: int = 0  # higher is tried first by auto-detection
    reads: tuple[str, ...] = ()  # further keys to_example reads (alpaca's input): never reported as left out


# --------------------------------------------------------------------------------------- tasks, backends


class Task:
    """A training objective. Subclass, set the class attributes, and implement :meth:`build`.

    - ``data_keys``: the config data paths the task reads (``data.train`` for sft); the first is the
      *training list* whose row indices the run events carry. ``optional_data_keys`` lists those of
      them the user may leave out.
    - ``formats``: the data formats it accepts.
    - ``capabilities``: what it offers other plugins (``per_row_losses``, ``streamable``, ...).

    A task for the transformers backend also defines ``encode(rows, tokenizer, config)``, which tokenises
    its rows; ``datasets_for(task, setup)`` calls it (``docs/plugins.md``, "The trainer seam", says what it
    returns).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    data_keys: ClassVar[tuple[str, ...]] = ("data.train",)
    optional_data_keys: ClassVar[tuple[str, ...]] = ()
    formats: ClassVar[tuple[str, ...]] = ()
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: The step metric (``OptimizerStep.metrics``) this task minimises, for the watchdog's divergence rule;
    #: empty: ``loss`` when ``capabilities`` has ``token_cross_entropy``, else only the non-finite rule.
    divergence_metric: ClassVar[str] = ""
    #: Raw-row keys beyond its format's own that the task reads (key -> the value of a row without it): kept
    #: in each row's example, so ``encode`` sees them; a key no format nor task reads is reported, not kept.
    extra_keys: ClassVar[Mapping[str, Any]] = {}

    def build(self, backend: Backend, context: Any) -> Any:  # pragma: no cover - interface
        """Build the backend-specific trainer for this task. ``context`` is what the backend passes: for
        transformers a ``TrainerSetup``, from which ``SoupTrainerMixin.from_setup`` builds the trainer."""
        raise NotImplementedError


class Backend:
    """A training engine. Subclass and implement :meth:`train`.

    The backend must consume the core's row order (:func:`soup_core.data.micro_batches`) and feed the
    run events to ``context.events``; it applies controller actions between optimizer steps.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: False for a backend that trains in one process: a run of several (``soup train --nproc N``, or a
    #: launcher) is then refused before any data or model is loaded, and before ``--nproc`` launches.
    multi_process: ClassVar[bool] = True
    #: True for a backend whose trainer runs (part of) the watchdog itself and whose plugin's pre-flight says
    #: which of its rules run (``watchdog off: ...``); for the others the transformers plugin says it is off.
    runs_watchdog: ClassVar[bool] = False

    def train(self, context: Any) -> Any:  # pragma: no cover - interface
        raise NotImplementedError


class LoadedModel:
    """What the model-loading hook returns: the model and tokenizer, and who loaded them."""

    def __init__(self, model: Any, tokenizer: Any, loaded_by: str = "", extra: dict[str, Any] | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.loaded_by = loaded_by
        self.extra: dict[str, Any] = dict(extra or {})

    def __repr__(self) -> str:
        return f"LoadedModel(model={type(self.model).__name__}, loaded_by={self.loaded_by!r})"


class PreflightReport:
    """What a pre-flight hook returns: lines for the plan and, optionally, a refusal (a reason: the run
    is refused before data or a model are loaded) with its fix."""

    def __init__(self, title: str = "", lines: list[str] | None = None, refusal: str | None = None,
                 fix: str | None = None) -> None:
        self.title = title
        self.lines: list[str] = list(lines or [])
        self.refusal = refusal
        self.fix = fix

    def __repr__(self) -> str:
        return f"PreflightReport(title={self.title!r}, lines={self.lines!r}, refusal={self.refusal!r})"


# ------------------------------------------------------------------------------- recorders, controllers


class Recorder:
    """An observer of a run. One instance is created per run (the class is registered).

    Every method runs inside a guard: an exception is reported once, names the plugin, disables this
    recorder, and the run goes on. A recorder must never change the run.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: False for a recorder that ignores micro-batch events: when no recorder wants them, a backend may
    #: skip computing per-row statistics altogether. Read at every micro-batch, so a recorder may make it
    #: a property that turns False once it has switched itself off.
    wants_micro_batches: ClassVar[bool] = True

    def on_run_start(self, event: RunStart) -> None:
        """The run is set up; ``event`` carries its id, output dir, config, fingerprint and row count."""

    def on_micro_batch(self, event: MicroBatch) -> None:
        """One micro-batch's forward pass is done: its rows, each row's loss and supervised tokens."""

    def on_optimizer_step(self, event: OptimizerStep) -> None:
        """An optimizer step completed, with its measured metrics."""

    def on_run_end(self, event: RunEnd) -> None:
        """The run is over (on every exit path)."""


class SetCoefficient(NamedTuple):
    """Controller action: set a named training coefficient (e.g. ``beta``) to ``value``."""

    name: str
    value: float


class Rollback(NamedTuple):
    """Controller action: restore model and optimizer from ``checkpoint`` (None: the latest good one)."""

    checkpoint: str | None = None
    reason: str = ""


class Stop(NamedTuple):
    """Controller action: stop the run; the tracker row is marked ``stopped`` with ``reason``. ``failed``:
    the run went wrong (``soup train`` exits 1), not merely done early."""

    reason: str
    failed: bool = False


class SkipUpdate(NamedTuple):
    """``before_update`` action: the pending optimizer update is not applied (the step counts, skipped).
    ``redo_without``: rows that spoilt it; a backend that can computes the step again without them (and
    any excluded rows) and applies that update instead; one that cannot, or every row gone, skips it."""

    reason: str
    redo_without: tuple[int, ...] = ()


class ExcludeRows(NamedTuple):
    """``before_update`` action: these training-list rows add no loss for the rest of the run (every
    later micro-batch, epoch and rank). ``shares`` (optional, same order) is each row's share of the step."""

    rows: tuple[int, ...]
    reason: str = ""
    shares: tuple[float, ...] = ()


ControllerAction = SetCoefficient | Rollback | Stop | SkipUpdate | ExcludeRows


class Controller:
    """Acts on a live run. One instance per run. Exceptions stop the run with the plugin named."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    tasks: ClassVar[tuple[str, ...]] = ()  # the tasks it acts on; empty means all
    #: True when ``before_update`` reads the step's rows (``PendingUpdate.rows``...): the backend then
    #: measures per-row losses even with no recorder, and gathers them from every rank.
    wants_rows: ClassVar[bool] = False

    def on_run_start(self, event: RunStart) -> Sequence[ControllerAction] | None:
        """Called once before the first step; may return ``ExcludeRows`` (rows out from the first step on,
        as a resumed run restores them)."""

    def before_update(self, event: PendingUpdate) -> Sequence[ControllerAction]:
        """Called after a step's gradients are ready and before the optimizer applies them, with the same
        event on every rank; returns ``SkipUpdate``, ``ExcludeRows`` or ``Stop`` (may be empty). A backend
        that cannot veto an update never calls it (docs/plugins.md, "Acting before an update")."""
        return ()

    def on_step(self, event: OptimizerStep) -> Sequence[ControllerAction]:
        """Called after every optimizer step; returns actions for the backend to apply (may be empty)."""
        return ()


# ------------------------------------------------------------------------------------------- commands


class Command(NamedTuple):
    """A CLI command (``soup NAME``). ``target`` is a function (a single command) or a ``typer.Typer``
    (a group). Its module must import light: heavy imports go inside the function body."""

    name: str
    target: Any
    help: str = ""


class ExportTarget(NamedTuple):
    """A format ``soup export TARGET --to NAME`` writes. ``run(target, **options)`` does the export: ``target``
    is the TARGET argument as given, ``options`` those of ``output``/``type``/``base`` the user gave (the
    command refuses one not in ``options``). It raises ``typer.Exit`` (after printing why) to fail."""

    name: str
    run: Callable[..., Any]
    help: str = ""
    options: tuple[str, ...] = ("output",)
