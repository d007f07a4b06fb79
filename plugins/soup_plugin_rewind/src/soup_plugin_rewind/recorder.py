"""The flight recorder: writes ``rewind.jsonl`` while a run trains.

One instance per run (per rank). Lines are buffered in memory and appended once per optimizer step, so
the cost is one small write per step. A recorder failure never reaches training: it prints one line and
stops recording.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from soup_core import Recorder
from soup_core.events import MicroBatch, OptimizerStep, RunEnd, RunStart
from soup_core.io import record_output
from soup_plugin_rewind.logfile import FORMAT_VERSION, LOG_FILE_PATTERN, loads_line, log_name

try:
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj) + b"\n"

except ImportError:  # pragma: no cover - exercised only where orjson is absent

    def _dumps(obj: Any) -> bytes:
        return (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode()


_FLUSH_BYTES = 4 << 20  # a step with a huge micro-batch count is flushed early to bound memory


def encode_header(
    *,
    backend: str,
    task: str,
    n_rows: int,
    batch_size: int,
    grad_accum: int,
    fingerprint: str,
    created: float | None = None,
    **extra: Any,
) -> bytes:
    """The header line. The first nine keys are the original format's; ``extra`` adds ours (run_id, rank,
    world_size, packing), which readers of the original format ignore."""
    header = {
        "kind": "header",
        "version": FORMAT_VERSION,
        "backend": backend,
        "task": task,
        "n_rows": n_rows,
        "batch_size": batch_size,
        "grad_accum": grad_accum,
        "dataset_fingerprint": fingerprint,
        "created": time.time() if created is None else created,
    }
    header.update(extra)
    return _dumps(header)


def encode_batch(
    step: int, micro: int, rows: Sequence[int], row_loss: Sequence[float], row_tokens: Sequence[int]
) -> bytes:
    """One micro-batch line; a non-finite loss is written as null (strict JSON)."""
    losses = []
    for value in row_loss:
        value = float(value)
        losses.append(value if math.isfinite(value) else None)
    return _dumps(
        {
            "kind": "batch",
            "step": int(step),
            "micro": int(micro),
            "rows": [int(r) for r in rows],
            "row_loss": losses,
            "row_tokens": [int(t) for t in row_tokens],
        }
    )


def encode_resume(from_step: int, run_id: str | None = None) -> bytes:
    """The marker a resumed run appends before its first new line."""
    marker: dict[str, Any] = {"kind": "resume", "from_step": int(from_step)}
    if run_id:
        marker["run_id"] = run_id
        marker["created"] = time.time()
    return _dumps(marker)


def _setting(config: Any, section: str, name: str, default: Any) -> Any:
    """``config.<section>.<name>`` from a pydantic model or a plain mapping."""
    part = config.get(section) if isinstance(config, Mapping) else getattr(config, section, None)
    if part is None:
        return default
    value = part.get(name, default) if isinstance(part, Mapping) else getattr(part, name, default)
    return default if value is None else value


def _continues(path: Path, fingerprint: str) -> bool:
    """Whether the log at ``path`` can be continued: it exists and its header is for the same data."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline()
    except FileNotFoundError:
        return False
    try:
        header = loads_line(first)
    except ValueError:
        return False
    return type(header) is dict and header.get("kind") == "header" and header.get("dataset_fingerprint") == fingerprint


def _copy_until(path: Path, from_step: int, out: Any) -> None:
    """Copy the header and every record up to ``from_step``; drop corrupt lines and a cut last line."""
    with open(path, "rb") as fh:
        header = fh.readline()
        out.write(header if header.endswith(b"\n") else header + b"\n")
        for line in fh:
            if not line.endswith(b"\n"):
                break  # a line cut by the crash we are resuming from
            try:
                obj = loads_line(line)
            except ValueError:
                continue
            if type(obj) is not dict:
                continue
            kind = obj.get("kind")
            if kind == "batch":
                step = obj.get("step")
                if type(step) is not int or step > from_step:
                    continue
            elif kind == "resume":
                if type(obj.get("from_step")) is not int or obj["from_step"] > from_step:
                    continue
            elif kind == "header":
                continue
            out.write(line)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _rotate(path: Path) -> None:
    """Keep one previous log: ``rewind.jsonl`` becomes ``rewind.jsonl.1``."""
    if path.exists() or path.is_symlink():
        os.replace(path, path.with_name(path.name + ".1"))


class RewindRecorder(Recorder):
    """Writes one line per micro-batch (rows, their losses and supervised tokens) to ``rewind.jsonl``.

    Rank 0 writes ``rewind.jsonl``, rank N ``rewind.rank<N>.jsonl``. A fresh run keeps the previous
    log as ``rewind.jsonl.1``; a resumed run continues it (lines after the checkpoint dropped, a
    ``resume`` marker added). Off (no file) when ``training.rewind_log`` is false.
    """

    name = "rewind"
    description = "flight recorder: the rows, losses and tokens of every micro-batch (rewind.jsonl)"

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self._report = report or _stderr
        self._state = "idle"  # idle -> recording -> off
        self._path: Path | None = None
        self._buf: list[bytes] = []
        self._buf_bytes = 0
        self._header: bytes | None = None  # written with the first micro-batch
        self._created = False  # the file exists (so later writes must not create it)
        self._saw_batch = False
        self._task = ""
        self._backend = ""
        self._key: tuple[str, int] = ("", 0)

    @property
    def wants_micro_batches(self) -> bool:  # type: ignore[override]
        """False once the log is off (``rewind_log: false``, a task without per-row losses, a write
        error): the backend then stops computing per-row losses for it."""
        return self._state in ("idle", "recording")

    # -------------------------------------------------------------------------------- the hooks

    def on_run_start(self, event: RunStart) -> None:
        self._guard(self._start, event)

    def on_micro_batch(self, event: MicroBatch) -> None:
        if self._state != "recording":
            return
        self._guard(self._record, event)

    def on_optimizer_step(self, event: OptimizerStep) -> None:
        if self._state != "recording":
            return
        if not self._saw_batch:
            # The backend ran a step without reporting any row: this task cannot be attributed.
            self._off(f"the {self._task!r} task on the {self._backend!r} backend reports no per-row losses")
            return
        from soup_plugin_rewind.guard import take_notes

        redone = bool(event.metrics.get("update_redone"))  # the backend ran the step again without the rows
        for note in take_notes(self._key):  # what the spike guard did at this step, after its batches
            self._buf.append(_dumps({**note, "update": "redone" if redone else "skipped"}))
        self._guard(self._flush)

    def on_run_end(self, event: RunEnd) -> None:
        if self._state == "recording" and self._buf:
            self._guard(self._flush)  # the partial step of a crashed run is the interesting one
        if self._state == "recording":
            self._state = "done"

    # ----------------------------------------------------------------------------------- workings

    def _guard(self, method: Callable[..., None], *args: Any) -> None:
        try:
            method(*args)
        except OSError as exc:
            self._disable(f"Rewind log disabled: {self._path or '?'}: {exc.strerror or exc}")
        except Exception as exc:  # noqa: BLE001 - a recorder must never break training
            self._disable(f"Rewind recorder disabled: {type(exc).__name__}: {exc}")

    def _disable(self, message: str) -> None:
        self._state = "off"
        self._buf.clear()
        self._report(message)

    def _off(self, reason: str) -> None:
        self._state = "off"
        self._buf.clear()
        self._report(f"Rewind log off: {reason}")

    def _start(self, event: RunStart) -> None:
        if not _setting(event.config, "training", "rewind_log", True):
            self._state = "off"  # the user said no: write nothing, say nothing
            return
        self._task, self._backend = event.task, event.backend
        out = Path(event.output_dir)
        self._path = out / log_name(event.rank)
        self._key = (str(out), event.rank)
        out.mkdir(parents=True, exist_ok=True)
        if event.rank == 0:  # the run owns every rank's log and its kept copy, even if it is killed
            record_output(out, *(f"{log_name(r)}{s}" for r in range(event.world_size) for s in ("", ".1")))
        self._header = encode_header(
            backend=event.backend,
            task=event.task,
            n_rows=event.n_rows,
            batch_size=event.batch_size,
            grad_accum=event.grad_accum,
            fingerprint=event.fingerprint,
            run_id=event.run_id,
            rank=event.rank,
            world_size=event.world_size,
            packing=bool(event.packing),
        )
        if event.resumed_from_step is None:
            _rotate(self._path)
            if event.rank == 0:
                self._rotate_stale_ranks(out, event.world_size)
        else:
            self._continue(event.resumed_from_step, event.fingerprint, event.run_id)
        self._state = "recording"

    def _rotate_stale_ranks(self, out: Path, world_size: int) -> None:
        """Rank files of an earlier, wider run would be merged into this run's view: move them aside."""
        for entry in out.iterdir():
            match = LOG_FILE_PATTERN.match(entry.name)
            if match and match.group(1) and not match.group(2) and int(match.group(1)) >= world_size:
                _rotate(entry)

    def _continue(self, from_step: int, fingerprint: str, run_id: str) -> None:
        """Resume: keep the log up to the checkpoint's step, then mark the resume. Streams, so a long log
        costs no memory."""
        assert self._path is not None and self._header is not None
        path = self._path
        usable = _continues(path, fingerprint)
        tmp = path.with_name(f".{path.name}.resume.tmp")
        try:
            with open(tmp, "wb") as out:
                if usable:
                    _copy_until(path, from_step, out)
                else:
                    out.write(self._header)
                out.write(encode_resume(from_step, run_id))
            if not usable:
                _rotate(path)  # a log this run cannot continue is kept aside, not destroyed
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._header = None
        self._created = True

    def _record(self, event: MicroBatch) -> None:
        if not self._saw_batch:
            self._saw_batch = True
            if self._header is not None:
                self._buf.append(self._header)
                self._buf_bytes += len(self._header)
                self._header = None
        line = encode_batch(event.step, event.micro, event.rows, event.row_loss, event.row_tokens)
        self._buf.append(line)
        self._buf_bytes += len(line)
        if self._buf_bytes > _FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        assert self._path is not None
        data = b"".join(self._buf)
        self._buf.clear()
        self._buf_bytes = 0
        if self._created:
            # No O_CREAT: if the file or its directory vanished, this fails rather than writing a
            # headless log (or writing into an unlinked inode nobody can read).
            fd = os.open(self._path, os.O_WRONLY | os.O_APPEND)
        else:
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._created = True
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
