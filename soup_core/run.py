"""One training run, from a config to a finished tracker row (what ``soup train`` does).

Order matters and is part of the contract: config → plugin requirements and deep probes → pre-flight
hooks → data → (dry run stops here) → tracker row → recorders/controllers → model (through the
``soup_load_model`` hook, inside the backend) → training. Everything after the tracker row starts runs
inside :func:`soup_core.tracker.tracked_run`, so every exit path ends the row.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RunRefused(RuntimeError):
    """The run cannot start (an unavailable plugin, a failed probe, a pre-flight refusal)."""


@dataclass
class Plan:
    """What a run will do; printed by ``soup train`` (and all that ``--dry-run`` does)."""

    config: Any
    output_dir: Path
    base_dir: Path | None = None  # the config file's folder: relative data paths resolve against it
    data: dict[str, Any] = field(default_factory=dict)  # data key -> TrainingList
    lines: list[str] = field(default_factory=list)
    preflight: list[tuple[str, Any]] = field(default_factory=list)  # (plugin, PreflightReport)
    finished: str = ""  # set when the checkpoint resumed from already trained all the config asks
    data_since: int = 0  # the step after which this run's data record vouches for its checkpoints


def output_dir_for(config: Any) -> Path:
    """``<output>`` or ``<output>/<experiment_name>``."""
    out = Path(config.output)
    return out / config.experiment_name if config.experiment_name else out


def dist_env() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment (torchrun / accelerate)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def plan_run(config: Any, *, plugins: Any, base_dir: Path | None = None) -> Plan:
    """Everything before the model: requirements, probes, pre-flight, data. Raises RunRefused or
    soup_core.data.DataError."""
    from soup_core.data import summarize
    from soup_core.data.rows_cache import cached_training_list, fill_ahead

    _, world_size = dist_env()
    backend_cls = plugins.backends.get(config.backend)
    if world_size > 1 and backend_cls is not None and not getattr(backend_cls, "multi_process", True):
        raise RunRefused(
            f"backend {config.backend!r} (plugin {plugins.backends.owner(config.backend)!r}) trains in one "
            f"process, and this run has {world_size} (--nproc or a launcher); run soup train without --nproc"
        )
    task_cls = plugins.tasks.get(config.task)
    formats = dict(plugins.data_formats.items())
    keys = [k.split(".", 1)[1] for k in getattr(task_cls, "data_keys", ())]
    keep = tuple(getattr(task_cls, "extra_keys", None) or ())  # the raw-row keys the task reads
    # the rows are read and validated on another core while the deep probe imports the backend's libraries
    ahead = [fill_ahead(config.data, formats=formats, base_dir=base_dir, key=key, accepted=task_cls.formats or None,
                        keep=keep) for key in keys if getattr(config.data, key, None)]
    try:
        problems = plugins.requirements_for(backend=config.backend, task=config.task, deep=True)
        if problems:
            raise RunRefused("\n".join(problems))
        plan = Plan(config=config, output_dir=output_dir_for(config), base_dir=base_dir)
        _resolve_resume(plan)
        for plugin, report in plugins.call_preflight(config):
            plan.preflight.append((plugin, report))
            if report.refusal:
                fix = f"\n  fix: {report.fix}" if report.fix else ""
                raise RunRefused(f"pre-flight check of plugin {plugin!r} refused the run: {report.refusal}{fix}")
        for key in task_cls.data_keys:
            attr = key.split(".", 1)[1]
            if getattr(config.data, attr, None) is None:
                continue  # optional data keys (required ones were enforced by the config)
            training = cached_training_list(  # read, validated and stored once per content of the files
                config.data, formats=formats, base_dir=base_dir, key=attr, accepted=task_cls.formats or None, keep=keep
            )
            plan.data[attr] = training
            plan.lines.append(f"data.{attr}: {summarize(training)}")
    except BaseException:  # refused or interrupted: no fill goes on after soup has exited
        for reap in ahead:
            reap(stop=True)
        raise
    for reap in ahead:
        reap()
    _refuse_other_files(plan)
    _refuse_changed_data(plan, task_cls.data_keys[0].split(".", 1)[1] if task_cls.data_keys else "train")
    return plan


def _refuse_changed_data(plan: Plan, key: str) -> None:
    """A resumed run continues the checkpoint's row order, row indices and epoch: refuse other rows than those
    it was trained on (its run's data record), before anything trains."""
    from soup_core.checkpoints import changed_data

    resume, training = plan.config.training.resume_from, plan.data.get(key)
    if not resume or plan.finished or training is None:
        return
    change, plan.data_since = changed_data(Path(resume), training, plan.base_dir)
    if change == "":
        plan.lines.append(f"{resume}: no data fingerprint is recorded for it (a run of an older Soup, or a checkpoint "
                          "moved out of its output folder), so the data could not be checked against its rows")
    elif change:
        raise RunRefused(f"training.resume_from: {resume} was trained on other rows: {change}; the resumed steps "
                         f"would continue its row order, row indices and epoch over another data set. Restore the "
                         "data it was trained on, or start a new run: without --resume, into another output "
                         "folder (--output) or with --overwrite")


def _refuse_other_files(plan: Plan) -> None:
    """A resumed run continues the checkpoint's row order, which several files' formats and weights decide:
    refuse a list of files that differs from the one its run trained on (that run's soup_config.yaml)."""
    import yaml

    from soup_core.data import DataError
    from soup_core.data.build import _entries

    resume, now = plan.config.training.resume_from, plan.config.data.train
    if not resume or plan.finished or not isinstance(now, (str, list)):
        return
    try:
        saved = yaml.safe_load((Path(resume).parent / "soup_config.yaml").read_text(encoding="utf-8"))
        before = saved["data"]["train"]
        same = _entries(before, "train") == _entries(now, "train")
    except (OSError, ValueError, TypeError, KeyError, DataError):
        return  # nothing recorded to compare with (a checkpoint copied out of its run's folder)
    if (isinstance(now, list) or isinstance(before, list)) and not same:
        raise RunRefused(f"training.resume_from: {resume} was trained on data.train {before}, this config has {now}: "
                         "the files, their formats or weights decide the row order the resumed steps continue; "
                         "resume with the same data.train, or start a new run")


def _resolve_resume(plan: Plan) -> None:
    """``training.resume_from`` (``latest``, an output folder, a checkpoint) becomes the checkpoint folder
    itself; a checkpoint that already trained all the config asks marks the plan finished."""
    from soup_core.checkpoints import ResumeError, finished_at, resolve_resume
    from soup_core.outputs import read_manifest

    value = plan.config.training.resume_from
    if not value:
        return
    folder = plan.output_dir if value == "latest" else Path(str(value)).expanduser()
    step = _finished_in(folder, plan.config)
    if step is not None:
        plan.finished = (f"nothing to resume: the run in {folder} finished at step {step}, where this config's "
                         "training ends; no new run was recorded")
        return
    try:
        checkpoint = resolve_resume(str(value), plan.output_dir)
    except ResumeError as exc:
        raise RunRefused(str(exc)) from None
    plan.config.training.resume_from = str(checkpoint)
    plan.lines.append(f"resume from: {checkpoint}")
    step = finished_at(checkpoint, plan.config)
    if step is not None and read_manifest(checkpoint.parent).get("status") in ("failed", "interrupted", "running"):
        # its run trained every step but ended before its final model was saved (a full disk): save it now
        plan.lines.append(f"{checkpoint} is the last step, but its run ended before the trained model was saved: "
                          "this run saves it")
    elif step is not None:
        plan.finished = (f"nothing to resume: {checkpoint} is at step {step}, where this config's training "
                         "ends; the run is finished, and no new run was recorded")


def _finished_in(folder: Path, config: Any) -> int | None:
    """The final step of a run that completed in output folder ``folder`` and trained all that ``config``
    asks (its manifest says so), else None."""
    from soup_core.outputs import read_manifest

    done = read_manifest(folder) if folder.is_dir() else {}
    steps = done.get("steps")
    if done.get("status") != "completed" or not isinstance(steps, int):
        return None
    t = config.training
    if t.max_steps:
        return steps if steps >= int(t.max_steps) else None
    same_length = not done.get("max_steps") and float(t.epochs) <= float(done.get("epochs") or 0)
    return steps if same_length else None


def execute(
    plan: Plan,
    *,
    plugins: Any,
    report: Callable[[str], None] = print,
    tracker: Any = None,
    run_id: str | None = None,
    overwrite: bool = False,
    on_claim: Callable[[Path, str], None] = lambda folder, run_id: None,
) -> dict[str, Any]:
    """Train: claim the output folder (rank 0; ``overwrite`` removes a previous run's files first), open the
    tracker row, build recorders/controllers and the context, call the backend. ``on_claim(folder, run_id)``
    runs on rank 0 once the folder is the run's (``soup train`` keeps its console output there)."""
    from soup_core.config import config_to_dict, dump_config_yaml
    from soup_core.data import DataError
    from soup_core.io import atomic_write
    from soup_core.run_context import RunContext
    from soup_core.run_events import RunEvents
    from soup_core.tracker import RunStopped, Tracker

    config = plan.config
    rank, world_size = dist_env()
    tracker = tracker or Tracker()
    config_dict = config_to_dict(config)
    # the tracker keeps data paths absolute, so a reader (soup rewind) can rebuild the rows from anywhere
    def absolute(path: str) -> str:
        return path if Path(path).is_absolute() else str(((plan.base_dir or Path.cwd()) / path).resolve())

    for key in plan.data:
        value = config_dict.get("data", {}).get(key)
        if isinstance(value, str):
            config_dict["data"][key] = absolute(value)
        elif isinstance(value, list):  # several files: each entry's path
            config_dict["data"][key] = [absolute(e) if isinstance(e, str) else {**e, "path": absolute(e["path"])}
                                        for e in value]
    start_kwargs: dict[str, Any] = dict(
        name=config.experiment_name, task=config.task, backend=config.backend, base_model=config.base,
        config=config_dict, output_dir=str(plan.output_dir.resolve()),
    )
    if run_id is not None:
        start_kwargs["run_id"] = run_id

    def _train(run_id: str) -> dict[str, Any]:
        from soup_core.outputs import record

        if rank == 0:
            plan.output_dir.mkdir(parents=True, exist_ok=True)
            record(plan.output_dir, "soup_config.yaml")  # listed before written: a killed run still owns it
            atomic_write(plan.output_dir / "soup_config.yaml", dump_config_yaml(config))
        task = plugins.tasks[config.task]()
        recorders = [(cls(), plugins.recorders.owner(name)) for name, cls in plugins.recorders.items()]
        controllers = [
            (cls(), plugins.controllers.owner(name))
            for name, cls in plugins.controllers.items()
            if not cls.tasks or config.task in cls.tasks
        ]
        events = RunEvents(recorders=recorders, controllers=controllers, report=report)

        def load_model() -> Any:
            import time

            started = time.monotonic()
            if rank == 0:  # loading a real model takes seconds to minutes: say what is happening
                report(f"loading the model {config.base} ...")
            loaded, by = plugins.call_load_model(config=config, backend=config.backend, task=task)
            if not getattr(loaded, "loaded_by", ""):
                loaded.loaded_by = by
            if rank == 0 and time.monotonic() - started >= 2:
                report(f"loaded in {time.monotonic() - started:.0f} s")
            return loaded

        def log_metrics(step: int, metrics: Mapping[str, float]) -> None:
            if rank == 0:
                tracker.log_metrics(run_id, step, metrics)

        # the task's first data key is its training list: the rows the run events index
        first_key = task.data_keys[0].split(".", 1)[1] if task.data_keys else "train"
        if rank == 0 and plan.data.get(first_key) is not None:  # what resuming a checkpoint of it checks
            from soup_core.checkpoints import DATA_RECORD, data_record

            rows = data_record(plan.data[first_key], plan.base_dir, plan.data_since)
            record(plan.output_dir, DATA_RECORD)
            atomic_write(plan.output_dir / DATA_RECORD, json.dumps(rows, indent=1))
        context = RunContext(
            config=config, run_id=run_id, output_dir=plan.output_dir, training=plan.data.get(first_key),
            task=task, events=events, load_model=load_model, log_metrics=log_metrics, rank=rank,
            world_size=world_size, resume_from=config.training.resume_from, report=report,
            extra={"data": plan.data, "plugins": plugins, "base_dir": plan.base_dir},
        )
        backend = plugins.backends[config.backend]()
        try:
            result = dict(backend.train(context) or {})
        except (RunStopped, KeyboardInterrupt, DataError):  # bad data is the user's to fix, not the backend's
            raise
        except Exception as exc:  # a backend fails loudly, with its plugin named
            owner = plugins.backends.owner(config.backend)
            raise RuntimeError(f"backend {config.backend!r} (plugin {owner!r}): {type(exc).__name__}: {exc}") from exc
        if rank == 0:  # after the backend saved the model: the card replaces PEFT's and trl's boilerplate
            from soup_core import __version__
            from soup_core.model_card import CARD, run_card, write_card

            record(plan.output_dir, CARD)
            losses = tracker.loss_summary(run_id)
            write_card(plan.output_dir, run_card(
                config=config_dict, data=plan.data, run_id=run_id, losses=losses,
                status=str(result.get("status") or "completed"), version=__version__,
                base_file=(result.get("base_gguf_path"), result.get("base_gguf_sha256"))))
            # in the run's summary too (soup runs show, the Done line): never a silent thinning of the data
            result.update({k: losses[k] for k in ("rows_excluded", "updates_skipped") if losses[k]})
        return result

    try:
        _join(world_size)  # the processes meet first: global rank 0 claims the folder, then tells the others
        if rank == 0:
            from soup_core.outputs import claimed, resumes_into
            from soup_core.tracker import new_run_id

            start_kwargs["run_id"] = rid = run_id or new_run_id()
            resuming = resumes_into(plan.output_dir, config.training.resume_from)
            told = False
            try:
                with claimed(plan.output_dir, rid, overwrite=overwrite, resuming=resuming, note=report) as claim:
                    _tell(world_size, rid, "")
                    told = True
                    if os.environ.get("SOUP_RUN_ID_FILE"):  # the launcher of this machine records a failure
                        Path(os.environ["SOUP_RUN_ID_FILE"]).write_text(rid, encoding="utf-8")
                    on_claim(plan.output_dir, rid)
                    summary = _execute_rank0(tracker, start_kwargs, _train, plugins, report)
                    claim.update(status=summary.get("status") or "completed", steps=summary.get("steps"),
                                 max_steps=config.training.max_steps, epochs=config.training.epochs)
            except BaseException as exc:
                if not told:  # the claim was refused: the other ranks stop with it
                    _tell(world_size, rid, str(exc) or type(exc).__name__)
                raise
        else:  # rank 0 owns the tracker row; the others train under its run id
            rid, refused = _tell(world_size, run_id or os.environ.get("SOUP_RUN_ID", "unknown"), None)
            if refused:
                from soup_core.outputs import OutputRefused

                raise OutputRefused(refused)
            summary = _train(rid)
    except BaseException:
        _close_process_group(wait=False)
        raise
    _close_process_group(wait=True)
    return summary


#: Seconds a collective waits for a rank before failing (``SOUP_COLLECTIVE_TIMEOUT``): a rank that hangs, or
#: whose machine is lost, fails the others within it, not after gloo's default 30 minutes. A rank that dies
#: closes its connections and fails the others at once.
COLLECTIVE_TIMEOUT_S = 300.0


def _join(world_size: int) -> None:
    """Join the process group the backend then trains in (accelerate takes an initialised one as it is), with
    the collective timeout. torchrun's rendezvous already gathered the processes and numbered them."""
    import importlib.util

    if world_size < 2 or importlib.util.find_spec("torch") is None:
        return
    import datetime

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    seconds = float(os.environ.get("SOUP_COLLECTIVE_TIMEOUT") or COLLECTIVE_TIMEOUT_S)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=seconds))


def _tell(world_size: int, run_id: str, refused: str | None) -> tuple[str, str | None]:
    """Global rank 0's run id and claim verdict (``refused``: why its claim of the output folder failed, ""
    when it holds it), on every rank."""
    dist = sys.modules.get("torch.distributed")
    if world_size < 2 or dist is None or not dist.is_initialized():
        return run_id, refused
    import torch

    box: list[Any] = [(run_id, refused)]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def _close_process_group(*, wait: bool) -> None:
    """Tear down the DDP process group before the interpreter exits.

    Left to interpreter shutdown, gloo's worker threads can outlive the group and a rank aborts with
    "terminate called without an active exception" after a run that finished. ``wait`` lines the
    ranks up first, so no rank tears down while another still talks to it.
    """
    dist = sys.modules.get("torch.distributed")  # never import torch just to find it was not used
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if wait:
        try:
            dist.barrier()
        except Exception:  # a peer already gone: nothing left to line up with
            pass
    dist.destroy_process_group()


def _execute_rank0(tracker: Any, start_kwargs: dict[str, Any], train: Callable[[str], dict[str, Any]],
                   plugins: Any, report: Callable[[str], None]) -> dict[str, Any]:
    from soup_core.tracker import RunStopped, tracked_run

    summary: dict[str, Any] = {}
    try:
        with tracked_run(tracker, **start_kwargs) as rid:
            summary = train(rid)
            summary.setdefault("run_id", rid)
            tracker.update_summary(rid, {k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
            if summary.get("status") == "stopped":  # a controller stopped it: the row says so, not "completed"
                raise RunStopped(str(summary.get("stop_reason") or "stopped by a controller"))
    except RunStopped:
        pass
    except BaseException as exc:  # the lines soup train says after its error line: notes on the exception
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        for line in _run_end(plugins, start_kwargs, status, exc, report):
            exc.add_note(line)
        raise
    for line in _run_end(plugins, start_kwargs, "stopped" if summary.get("status") == "stopped" else "completed",
                         None, report):
        report(line)
    return summary


def _run_end(plugins: Any, start: dict[str, Any], status: str, exc: BaseException | None,
             report: Callable[[str], None]) -> list[str]:
    """Every ``soup_run_end``'s lines; a plugin that raises there is named, and the run's outcome stands."""
    lines: list[str] = []
    for plugin in plugins._implementers("soup_run_end"):
        try:
            said = plugins.call_one("soup_run_end", plugin, run_id=start["run_id"], output_dir=start["output_dir"],
                                    status=status, exception=exc)
            lines += [str(line) for answer in said for line in (answer or ())]
        except Exception as failure:  # noqa: BLE001 - an observer never changes how the run ended
            report(f"plugin {plugin!r} failed at the run's end: {type(failure).__name__}: {failure}")
    return lines
