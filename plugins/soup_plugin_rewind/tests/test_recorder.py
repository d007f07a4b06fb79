"""The recorder: what it writes, rotation, resume, DDP file names, and that no failure reaches training."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from pathlib import Path

import pytest

from soup_core.events import MicroBatch, OptimizerStep, RunEnd, RunStart
from soup_plugin_rewind import recorder as recorder_mod
from soup_plugin_rewind.analysis import log_spikes
from soup_plugin_rewind.logfile import read_log
from soup_plugin_rewind.recorder import RewindRecorder

FP = "cd" * 32


def start(out: Path, *, run_id: str = "run_a", rank: int = 0, world_size: int = 1, resumed: int | None = None,
          on: bool = True, fingerprint: str = FP, task: str = "sft") -> RunStart:
    return RunStart(
        run_id=run_id, output_dir=str(out), config={"training": {"rewind_log": on}}, fingerprint=fingerprint,
        n_rows=40, rank=rank, world_size=world_size, resumed_from_step=resumed, backend="transformers",
        task=task, batch_size=2, grad_accum=2, packing=False,
    )


class Run:
    """Drives a recorder like a backend would, collecting what it reports."""

    def __init__(self, out: Path, **kwargs: object) -> None:
        self.messages: list[str] = []
        self.rec = RewindRecorder(report=self.messages.append)
        self.rank = int(kwargs.get("rank", 0))  # type: ignore[arg-type]
        self.rec.on_run_start(start(out, **kwargs))  # type: ignore[arg-type]

    def step(self, step: int, micro_batches: list[tuple[list[int], list[float], list[int]]]) -> None:
        for micro, (rows, losses, tokens) in enumerate(micro_batches):
            self.rec.on_micro_batch(MicroBatch(step, micro, tuple(rows), tuple(losses), tuple(tokens), self.rank))
        self.rec.on_optimizer_step(OptimizerStep(step, {"loss": 1.0}, self.rank))

    def end(self, status: str = "completed", steps: int = 0) -> None:
        self.rec.on_run_end(RunEnd(status, None, self.rank, steps))


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_writes_header_and_batches_in_the_original_format(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.step(1, [([0, 1], [1.5, math.nan], [10, 20]), ([2, 3], [1.0, math.inf], [5, 0])])
    run.step(2, [([4, 5], [0.5, 0.25], [8, 8]), ([6, 7], [0.5, 0.5], [8, 8])])
    run.end()
    data = lines(tmp_path / "rewind.jsonl")
    header = data[0]
    assert list(header)[:9] == [
        "kind", "version", "backend", "task", "n_rows", "batch_size", "grad_accum", "dataset_fingerprint",
        "created",
    ]
    assert header["version"] == 1 and header["dataset_fingerprint"] == FP and header["grad_accum"] == 2
    assert header["run_id"] == "run_a" and header["rank"] == 0
    assert data[1] == {"kind": "batch", "step": 1, "micro": 0, "rows": [0, 1], "row_loss": [1.5, None],
                       "row_tokens": [10, 20]}
    assert data[2]["row_loss"] == [1.0, None] and data[2]["micro"] == 1
    assert len(data) == 5 and run.messages == []
    # strict JSON throughout
    for line in (tmp_path / "rewind.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard constant {c}"))


def test_lines_reach_disk_at_every_optimizer_step(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.step(1, [([0], [1.0], [10])])
    assert len(lines(tmp_path / "rewind.jsonl")) == 2
    run.rec.on_micro_batch(MicroBatch(2, 0, (1,), (1.0,), (10,)))
    assert len(lines(tmp_path / "rewind.jsonl")) == 2  # buffered until the step ends
    run.end("failed")  # ... or the run does: the partial step of a crash is kept
    assert len(lines(tmp_path / "rewind.jsonl")) == 3


def test_a_previous_log_is_kept_as_dot_1(tmp_path: Path) -> None:
    first = Run(tmp_path, run_id="run_a")
    first.step(1, [([0], [1.0], [10])])
    first.end()
    second = Run(tmp_path, run_id="run_b")
    second.step(1, [([9], [2.0], [10])])
    second.end()
    assert lines(tmp_path / "rewind.jsonl")[0]["run_id"] == "run_b"
    assert lines(tmp_path / "rewind.jsonl.1")[0]["run_id"] == "run_a"


def test_rewind_log_false_writes_nothing_and_says_nothing(tmp_path: Path) -> None:
    (tmp_path / "rewind.jsonl").write_text("old\n")
    run = Run(tmp_path, on=False)
    run.step(1, [([0], [1.0], [10])])
    run.end()
    assert run.messages == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rewind.jsonl"]
    assert (tmp_path / "rewind.jsonl").read_text() == "old\n"


def test_a_recorder_that_is_off_stops_asking_for_per_row_losses(tmp_path: Path) -> None:
    from soup_core.run_events import RunEvents

    off = RunEvents(recorders=[(RewindRecorder(report=lambda _: None), "rewind")])
    on = RunEvents(recorders=[(RewindRecorder(report=lambda _: None), "rewind")])
    assert off.has_recorders and on.has_recorders  # before the run starts, nobody knows
    off.run_start(start(tmp_path / "off", on=False))
    on.run_start(start(tmp_path / "on"))
    assert not off.has_recorders  # the backend may skip the per-row work
    assert on.has_recorders  # control: a recording log still wants it


def test_a_task_without_per_row_losses_switches_it_off_with_one_line(tmp_path: Path) -> None:
    run = Run(tmp_path, task="dpo")
    run.rec.on_optimizer_step(OptimizerStep(1))
    run.rec.on_optimizer_step(OptimizerStep(2))
    run.end()
    assert run.messages == ["Rewind log off: the 'dpo' task on the 'transformers' backend reports no per-row losses"]
    assert not (tmp_path / "rewind.jsonl").exists()


def test_ddp_ranks_write_their_own_files_and_read_as_one(tmp_path: Path) -> None:
    (tmp_path / "rewind.rank3.jsonl").write_text("stale from a 4-process run\n")
    r0 = Run(tmp_path, rank=0, world_size=2)
    r1 = Run(tmp_path, rank=1, world_size=2)
    r0.step(1, [([0], [1.0], [10])])
    r1.step(1, [([1], [3.0], [10])])
    for run in (r0, r1):
        run.end()
    assert lines(tmp_path / "rewind.rank1.jsonl")[0]["rank"] == 1
    assert (tmp_path / "rewind.rank3.jsonl.1").exists() and not (tmp_path / "rewind.rank3.jsonl").exists()
    log = read_log(tmp_path / "rewind.jsonl")
    assert len(log.files) == 2 and log.step_loss(0) == 2.0


def test_resume_continues_the_log_from_the_checkpoint(tmp_path: Path) -> None:
    first = Run(tmp_path, run_id="run_a")
    for step in range(1, 7):
        first.step(step, [([step], [1.0], [10])])
    first.end("failed")
    with open(tmp_path / "rewind.jsonl", "ab") as fh:
        fh.write(b'{"kind": "batch", "step": 7, "mi')  # the crash cut a line
    second = Run(tmp_path, run_id="run_b", resumed=4)
    for step in range(5, 8):
        second.step(step, [([100 + step], [1.0 if step != 6 else 9.0], [10])])
    second.end()
    data = lines(tmp_path / "rewind.jsonl")
    assert [d["kind"] for d in data] == ["header"] + ["batch"] * 4 + ["resume"] + ["batch"] * 3
    assert data[5]["from_step"] == 4 and data[5]["run_id"] == "run_b"
    assert not (tmp_path / "rewind.jsonl.1").exists()  # continued, not rotated
    log = read_log(tmp_path / "rewind.jsonl")
    assert log.skipped.total == 0 and list(log.steps) == [1, 2, 3, 4, 5, 6, 7]
    assert [r.row for r in log.step_rows(5)] == [105]
    assert [s.step for s in log_spikes(log)] == [6]
    assert log.run_ids == ["run_a", "run_b"]


def test_resume_without_a_usable_log_starts_one_with_the_marker(tmp_path: Path) -> None:
    (tmp_path / "rewind.jsonl").write_text(json.dumps({"kind": "header", "version": 1,
                                                       "dataset_fingerprint": "other"}) + "\n")
    run = Run(tmp_path, resumed=10)
    run.step(11, [([3], [1.0], [10])])
    run.end()
    data = lines(tmp_path / "rewind.jsonl")
    assert [d["kind"] for d in data] == ["header", "resume", "batch"]
    assert data[0]["dataset_fingerprint"] == FP
    assert lines(tmp_path / "rewind.jsonl.1")[0]["dataset_fingerprint"] == "other"
    assert run.messages == []


def test_full_disk_disables_with_one_line_and_training_goes_on(tmp_path: Path, monkeypatch) -> None:
    run = Run(tmp_path)
    run.step(1, [([0], [1.0], [10])])
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, fd: int, mode: str) -> None:
            self._fh = real_fdopen(fd, mode)

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: object) -> None:
            self._fh.close()

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(recorder_mod.os, "fdopen", FullDisk)
    run.step(2, [([1], [1.0], [10])])
    run.step(3, [([2], [1.0], [10])])
    run.end()
    path = tmp_path / "rewind.jsonl"
    assert run.messages == [f"Rewind log disabled: {path}: No space left on device"]
    assert len(lines(path)) == 2  # what was written before the disk filled up stays readable


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Path:
    """A folder where creating a file fails: chmod where that binds (not root), else /sys (root too)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    probe = folder / "probe"
    try:
        probe.write_text("x")
    except OSError:
        yield folder
        folder.chmod(0o755)
        return
    probe.unlink()
    folder.chmod(0o755)
    sysfs = Path("/sys/kernel")
    try:
        (sysfs / "rewind-probe").write_text("x")
    except OSError:
        yield sysfs
        return
    pytest.skip("no read-only folder available on this machine")


def test_read_only_directory(read_only_dir: Path) -> None:
    run = Run(read_only_dir)
    run.step(1, [([0], [1.0], [10])])
    run.step(2, [([0], [1.0], [10])])
    run.end()
    assert len(run.messages) == 1
    assert run.messages[0].startswith(f"Rewind log disabled: {read_only_dir / 'rewind.jsonl'}: ")
    assert not (read_only_dir / "rewind.jsonl").exists()


def test_directory_vanishing_mid_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = Run(out)
    run.step(1, [([0], [1.0], [10])])
    shutil.rmtree(out)
    run.step(2, [([1], [1.0], [10])])
    run.step(3, [([2], [1.0], [10])])
    run.end()
    assert run.messages == [f"Rewind log disabled: {out / 'rewind.jsonl'}: No such file or directory"]
    assert not out.exists()  # it did not quietly re-create the folder or a headless log


def test_log_file_deleted_mid_run_is_not_recreated_headless(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.step(1, [([0], [1.0], [10])])
    (tmp_path / "rewind.jsonl").unlink()
    run.step(2, [([1], [1.0], [10])])
    assert len(run.messages) == 1 and "No such file or directory" in run.messages[0]
    assert not (tmp_path / "rewind.jsonl").exists()


def test_an_unexpected_error_disables_the_recorder_not_the_run(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.rec.on_micro_batch(MicroBatch(1, 0, (0,), ("not a number",), (10,)))  # type: ignore[arg-type]
    run.step(1, [([0], [1.0], [10])])
    run.end()
    assert len(run.messages) == 1 and run.messages[0].startswith("Rewind recorder disabled: ValueError")


def test_a_bad_run_start_never_raises(tmp_path: Path) -> None:
    messages: list[str] = []
    rec = RewindRecorder(report=messages.append)
    rec.on_run_start(start(tmp_path / "file-not-dir" / "x"))  # fine: folders are created
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the output folder should be")
    rec2 = RewindRecorder(report=messages.append)
    rec2.on_run_start(start(blocker))
    rec2.on_micro_batch(MicroBatch(1, 0, (0,), (1.0,), (1,)))
    rec2.on_optimizer_step(OptimizerStep(1))
    assert len(messages) == 1 and messages[0].startswith(f"Rewind log disabled: {blocker / 'rewind.jsonl'}")


def test_resume_of_a_log_cut_after_its_header(tmp_path: Path) -> None:
    first = Run(tmp_path)
    first.step(1, [([0], [1.0], [10])])
    first.end()
    path = tmp_path / "rewind.jsonl"
    path.write_bytes(path.read_bytes().split(b"\n")[0])  # the header, without its newline
    second = Run(tmp_path, resumed=1, run_id="run_b")
    second.step(2, [([1], [1.0], [10])])
    second.end()
    assert [d["kind"] for d in lines(path)] == ["header", "resume", "batch"]
