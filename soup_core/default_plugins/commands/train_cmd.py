"""``soup train``: validate, plan, and run one training run from a YAML config.

``--nproc N`` launches N processes through torchrun (DDP); nothing home-made. The launcher picks the run id,
so every rank records events under the same run; rank 0 owns the tracker row and the outputs. The same thing
by hand::

    SOUP_RUN_ID=$(python -c "from soup_core.tracker import new_run_id; print(new_run_id())") \\
    torchrun --standalone --nproc_per_node 2 -m soup_core train -c soup.yaml
    accelerate launch --num_processes 2 -m soup_core train -c soup.yaml

(without ``SOUP_RUN_ID`` the non-zero ranks record under the id ``unknown``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

OVERRIDES_ENV = "SOUP_CONFIG_OVERRIDES"
RUN_ID_ENV = "SOUP_RUN_ID"
RUN_ID_FILE_ENV = "SOUP_RUN_ID_FILE"  # the launcher learns global rank 0's run id there
LAUNCH_ENV = "SOUP_LAUNCH_FLAGS"  # the launcher's --nproc/--nnodes/rendezvous flags, for the resume command

TRAIN_HELP = """Train from a YAML config (default: ./soup.yaml, as written by `soup init`).

Order: validate the config → check plugins and probes → pre-flight → load and check the data →
(--dry-run stops here and loads no model) → train, recording the run in the tracker.

An output folder belongs to one run at a time (a lock, OUTPUT/.soup.lock), and a folder that holds
another run's files is refused unless the run resumes from it or --overwrite removes them. --overwrite
removes only what a Soup run recorded writing there (listed in OUTPUT/.soup_run.json, with its checkpoint-*
folders); a folder holding files no run recorded (your own model, an older Soup's output) is refused, and
--overwrite never removes them. An output folder that is, contains or lies inside the base model's folder,
or that is or contains a data file's or the config file's folder, is refused before anything is touched.

--nproc N trains on N processes of this machine (DDP, or training.sharding); on several machines,
start the same command on each with --nnodes, its own --node-rank and one --rdzv-endpoint
(docs/distributed.md). A process that dies stops the others; the run is recorded failed.

SIGTERM (a scheduler's pre-emption) and Ctrl-C save a checkpoint at the step in progress and print the
command that resumes from it. --resume latest (or --resume OUTPUT_DIR) picks the newest complete
checkpoint; resuming a run that already finished says so, exits 0 and records no run.

Exit codes: 0 trained (or the dry run passed, or nothing left to resume); 1 bad config, bad data, a
refused or failed run (an output folder in use or holding another run's files, a failed save, a run the
watchdog stopped: recorded stopped);
2 usage error; 130 interrupted by Ctrl-C, 143 by SIGTERM (the tracker row is marked interrupted)."""


def env_overrides() -> dict[str, Any]:
    """The overrides the launcher passed to each rank (empty outside a ``--nproc`` launch); kept for callers of
    the old ``soup_core.distributed``."""
    return json.loads(os.environ.get(OVERRIDES_ENV) or "{}")


def env_run_id() -> str | None:
    """The run id the launcher gave every rank, or None; kept for callers of the old ``soup_core.distributed``."""
    return os.environ.get(RUN_ID_ENV) or None


def _overrides(**flags: Any) -> dict[str, Any]:
    paths = {
        "lr": "training.learning_rate",
        "epochs": "training.epochs",
        "max_steps": "training.max_steps",
        "batch_size": "training.batch_size",
        "grad_accum": "training.gradient_accumulation_steps",
        "output": "output",
        "backend": "backend",
        "experiment_name": "experiment_name",
        "resume": "training.resume_from",
        "base": "base",
        "data": "data.train",
        "seed": "training.seed",
    }
    return {paths[k]: v for k, v in flags.items() if v is not None}


#: The option that sets each overridden config path, so an error in its value names the option.
FLAGS = {
    "training.learning_rate": "--lr", "training.epochs": "--epochs", "training.max_steps": "--max-steps",
    "training.batch_size": "--batch-size", "training.gradient_accumulation_steps": "--grad-accum",
    "output": "--output", "backend": "--backend", "experiment_name": "--name", "training.resume_from": "--resume",
    "base": "--base", "data.train": "--data", "training.seed": "--seed",
    "training.stream_allow_oom_attempt": "--allow-oom-attempt",
}


#: Config paths that name files or folders and may be given on the command line.
PATH_OPTIONS = ("data.train", "output")


def _from_cwd(overrides: dict[str, Any]) -> dict[str, Any]:
    """Paths typed on the command line mean what the shell means: relative to the working directory."""
    out = dict(overrides)
    for key in PATH_OPTIONS:
        value = out.get(key)
        if isinstance(value, str) and value and not Path(os.path.expanduser(value)).is_absolute():
            out[key] = str(Path.cwd() / value)
    base = out.get("base")
    # a base is a path only where it names one: a hub id (org/name) reads like a relative path too
    if isinstance(base, str) and not Path(os.path.expanduser(base)).is_absolute():
        if base.startswith(("./", "../")) or Path(base).is_dir() or (
                base.lower().endswith(".gguf") and Path(base).is_file()):  # else the run records it relative
            out["base"] = str((Path.cwd() / base).resolve())
    return out


def _from_config_folder(config: Any, folder: Path, overrides: dict[str, Any]) -> None:
    """Paths written in the config file are relative to the file's folder (data paths already resolve
    there when the data is read): ``output``, ``training.resume_from``, and a ``base`` that is a relative
    path to a folder or a ``.gguf`` file there."""
    if "output" not in overrides and not Path(os.path.expanduser(str(config.output))).is_absolute():
        config.output = str(folder / str(config.output))
    base = str(config.base)
    if "base" not in overrides and not Path(os.path.expanduser(base)).is_absolute():
        if base.startswith(("./", "../")) or (folder / base).is_dir() or (
                base.lower().endswith(".gguf") and (folder / base).is_file()):
            config.base = str((folder / base).resolve())
    resume = config.training.resume_from
    if ("training.resume_from" not in overrides and resume and resume != "latest"
            and not Path(os.path.expanduser(resume)).is_absolute()):
        config.training.resume_from = str(folder / resume)


def _overlap(plan: Any, config_dir: Path) -> str | None:
    """Why ``plan``'s output folder would put a run's files among its inputs: it is, contains or lies inside
    the base model's folder (a file base: is or contains the file's folder), or it is or contains a data file's
    folder or the config's own folder (lying inside the config's folder is normal: ./output does). --overwrite
    could otherwise remove them, and a run's save replace them."""
    from soup_core.data.build import _entries, _get, _resolve

    out = plan.output_dir.expanduser().resolve()
    base = Path(os.path.expanduser(str(plan.config.base)))
    inputs = [(base.resolve(), "the base model's folder")] if base.is_dir() else []
    if base.is_file():
        inputs.append((base.resolve().parent, f"the folder of the base model {base}"))
    for key in plan.data:
        with contextlib.suppress(Exception):  # the data was read already: what is wrong with it was said
            inputs += [(_resolve(raw, plan.base_dir).resolve().parent, f"the folder of data file {raw}")
                       for raw, _, _ in _entries(_get(plan.config.data, key), key)]
    inputs.append((config_dir, "the config file's folder"))
    for folder, what in inputs:
        how = ("is" if out == folder else "contains" if out in folder.parents else
               "lies inside" if what == "the base model's folder" and folder in out.parents else "")
        if how:
            return (f"output: the output folder {out} {how} {what} ({folder}): a run writes and --overwrite "
                    "removes files there; choose another output folder (-o, or output: in the config)")
    return None


def _blame_options(exc: Any, overrides: dict[str, Any]) -> str:
    """The config error, with each issue in a value given on the command line put on its option rather
    than on the config file."""
    import dataclasses

    from soup_core.config import ConfigError

    issues = [
        dataclasses.replace(issue, path=f"{FLAGS.get(issue.path, 'the command line')} {overrides[issue.path]} "
                            f"({issue.path})", line=None, column=None)
        if issue.path in overrides else issue
        for issue in exc.issues
    ]
    on_options = all(issue.path.startswith("-") for issue in issues)
    return ConfigError(issues, "the command line" if on_options else exc.source).render()


def train(
    config: Path = typer.Option(Path("soup.yaml"), "--config", "-c", help="The YAML config to train from."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate config, plugins, probes and data; "
                                 "print the plan; load no model."),
    lr: float | None = typer.Option(None, "--lr", help="Override training.learning_rate."),
    epochs: int | None = typer.Option(None, "--epochs", help="Override training.epochs."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Override training.max_steps."),
    batch_size: int | None = typer.Option(None, "--batch-size", help="Override training.batch_size."),
    grad_accum: int | None = typer.Option(None, "--grad-accum",
                                          help="Override training.gradient_accumulation_steps."),
    output: str | None = typer.Option(None, "--output", "-o", help="Override output."),
    experiment_name: str | None = typer.Option(None, "--name", help="Override experiment_name."),
    backend: str | None = typer.Option(None, "--backend", help="Override backend."),
    base: str | None = typer.Option(None, "--base", help="Override base (model folder, .gguf file or hub id)."),
    data: str | None = typer.Option(None, "--data", help="Override data.train."),
    seed: int | None = typer.Option(None, "--seed", help="Override training.seed."),
    resume: str | None = typer.Option(None, "--resume", help="Resume from a checkpoint folder, an output "
                                      "folder's newest complete checkpoint (--resume OUTPUT_DIR), or 'latest' "
                                      "(this config's output folder); overrides training.resume_from."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Remove a previous run's files from the output "
                                   "folder first (only what Soup wrote there; see above)."),
    nproc: int = typer.Option(
        1, "--nproc", min=1,
        help="Train on N processes (DDP through torchrun); the config, probes, pre-flight and data are "
        "checked once before any process starts. Per machine with --nnodes.",
    ),
    nnodes: int = typer.Option(1, "--nnodes", min=1, help="Machines in the run: start soup train on each, "
                               "with the same config, --nproc and --rdzv-endpoint and its own --node-rank "
                               "(torchrun's rendezvous; see docs/distributed.md)."),
    node_rank: int = typer.Option(0, "--node-rank", min=0, help="This machine's index, 0 to --nnodes - 1."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of one machine of the "
                                             "run, which every machine reaches; needed with --nnodes."),
    rdzv_id: str | None = typer.Option(None, "--rdzv-id", help="The rendezvous id; default: derived from the "
                                       "config and the command line, so every machine derives the same."),
    allow_oom_attempt: bool = typer.Option(False, "--allow-oom-attempt", help="Train even when a memory "
                                           "pre-flight predicts the run will not fit (layer streaming)."),
    cloud: bool = typer.Option(False, "--cloud", help="Write a SkyPilot task (soup-sky.yaml, next to the config) "
                               "for --nnodes cloud machines and print the command that launches it; nothing is "
                               "launched (soup-plugin-cloud; docs/distributed.md)."),
    cloud_submit: bool = typer.Option(False, "--cloud-submit", help="--cloud, then launch the task through "
                                      "SkyPilot's Python API (pip install 'soup-core[cloud]') and record the run."),
    gpus: str | None = typer.Option(None, "--gpus", metavar="NAME:N", help="With --cloud: accelerators per "
                                    "machine (A100:8); default: the smallest that fits the memory estimate."),
    spot: bool = typer.Option(False, "--spot", help="With --cloud: spot machines, as a SkyPilot managed job "
                              "that resumes with --resume latest after a pre-emption."),
    cloud_name: str | None = typer.Option(None, "--cloud-name", help="With --cloud: the cluster or job name."),
    cloud_store: str | None = typer.Option(None, "--cloud-store", metavar="URI", help="With --cloud: the bucket "
                                           "(s3://, gs://, r2://...) that checkpoints and the model go to."),
) -> None:
    """Train a model from a YAML config."""
    overrides = _overrides(lr=lr, epochs=epochs, max_steps=max_steps, batch_size=batch_size,
                           grad_accum=grad_accum, output=output, experiment_name=experiment_name,
                           backend=backend, base=base, data=data, seed=seed, resume=resume)
    if allow_oom_attempt:  # the streaming plugin's field; without that plugin the config says which to install
        overrides["training.stream_allow_oom_attempt"] = True
    if cloud or cloud_submit or gpus or spot or cloud_name or cloud_store:
        options = {"submit": cloud_submit, "gpus": gpus, "nnodes": nnodes, "nproc": nproc, "spot": spot,
                   "name": cloud_name, "store": cloud_store, "overwrite": overwrite, "overrides": _from_cwd(overrides),
                   "node_flags": bool(node_rank or rdzv_endpoint or rdzv_id), "cloud": cloud or cloud_submit}
        raise typer.Exit(_elsewhere(config, options))
    if overwrite and resume:
        from soup_core.ui import print_error

        print_error("--overwrite removes the checkpoints --resume would continue from; use one of them")
        raise typer.Exit(2)
    nodes = None
    if nnodes > 1 or rdzv_endpoint or rdzv_id or node_rank:
        problem = ("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (one machine of the run)" if not rdzv_endpoint
                   else f"--node-rank {node_rank} is not below --nnodes {nnodes}" if node_rank >= nnodes else "")
        if problem:
            from soup_core.ui import print_error

            print_error(problem)
            raise typer.Exit(2)
        nodes = {"nnodes": nnodes, "node_rank": node_rank, "endpoint": rdzv_endpoint,
                 "rdzv_id": rdzv_id or rendezvous_id(config, overrides, nnodes=nnodes, nproc=nproc)}
    code = run_train_command(config, overrides=overrides, dry_run=dry_run, nproc=nproc, overwrite=overwrite,
                             nodes=nodes)
    raise typer.Exit(code)


def _elsewhere(config: Path, options: dict[str, Any]) -> int:
    """``soup train --cloud``: the plugin that answers ``soup_train_elsewhere`` runs it (docs/plugins.md)."""
    from soup_core.plugins import load_plugins
    from soup_core.ui import print_error

    code = load_plugins().pm.hook.soup_train_elsewhere(config_path=config, options=options)
    if code is None:
        print_error("soup train --cloud needs the plugin soup-plugin-cloud: pip install soup-plugin-cloud")
        return 1
    return int(code)


def rendezvous_id(config: Path, overrides: dict[str, Any], *, nnodes: int, nproc: int) -> str:
    """The same id on every machine that starts this config with these options (the config file's bytes,
    the overrides as typed, the shape of the run), so the launches find each other without --rdzv-id."""
    import hashlib

    digest = hashlib.sha256(config.read_bytes() if config.is_file() else b"")
    digest.update(json.dumps([overrides, nnodes, nproc], sort_keys=True, default=str).encode())
    return "soup-" + digest.hexdigest()[:16]


def run_train_command(
    config_path: Path, *, overrides: dict[str, Any], dry_run: bool, nproc: int = 1, overwrite: bool = False,
    nodes: dict[str, Any] | None = None,
) -> int:
    """The body of ``soup train``; returns the exit code. Never lets a traceback reach the user. What it
    prints is kept in the run's output folder (``soup-output.log``, :mod:`.console_log`)."""
    from soup_core.default_plugins.commands.console_log import kept_output

    with kept_output() as kept:
        return _train_command(config_path, overrides=overrides, dry_run=dry_run, nproc=nproc, overwrite=overwrite,
                              nodes=nodes, kept=kept)


def _said_last(exc: BaseException) -> None:
    """The lines the plugins' ``soup_run_end`` hooks gave for a run that failed or was interrupted (notes on
    its exception): the last lines ``soup train`` prints."""
    from soup_core.ui import err_console

    for note in getattr(exc, "__notes__", ()):
        err_console.print(note, markup=False, highlight=False, soft_wrap=True)


def _train_command(
    config_path: Path, *, overrides: dict[str, Any], dry_run: bool, nproc: int, overwrite: bool,
    nodes: dict[str, Any] | None, kept: Any,
) -> int:
    from rich.markup import escape

    from soup_core.config import ConfigError, load_config
    from soup_core.data import DataError
    from soup_core.plugins import load_plugins
    from soup_core.run import RunRefused, execute, plan_run
    from soup_core.ui import console, print_error

    def fail(message: str) -> int:
        print_error(message)
        return 1

    if not config_path.exists():
        return fail(f"{config_path}: no such config file. Write one with `soup init`, or pass --config PATH.")
    # a rank started by launch() gets the launcher's overrides
    overrides = {**json.loads(os.environ.get(OVERRIDES_ENV) or "{}"), **_from_cwd(overrides)}
    plugins = load_plugins()
    try:
        config = load_config(config_path, plugins=plugins, overrides=overrides)
    except ConfigError as exc:
        return fail(_blame_options(exc, overrides))
    _from_config_folder(config, config_path.resolve().parent, overrides)
    try:
        # the launcher checks once what every rank would refuse (probes, pre-flight, data), as the run it
        # will be: pre-flight checks read the world size from WORLD_SIZE, as the ranks do
        world = nproc * (nodes or {}).get("nnodes", 1)
        with _world_size(world if world > 1 else None):
            plan = plan_run(config, plugins=plugins, base_dir=config_path.resolve().parent)
    except DataError as exc:
        return fail(str(exc) + (f"\n  fix: {exc.fix}" if getattr(exc, "fix", "") else ""))
    except RunRefused as exc:
        return fail(str(exc))
    if plan.finished:
        console.print(escape(plan.finished))
        return 0
    from soup_core.default_plugins.transformers.checks import output_problem

    problem = output_problem(plan.output_dir) or _overlap(plan, config_path.resolve().parent)
    if problem:
        return fail(problem)
    if dry_run or world > 1:  # what rank 0's claim of the output folder would refuse, before any process starts
        from soup_core.outputs import OutputRefused, check_free, resumes_into

        try:
            check_free(plan.output_dir, overwrite=overwrite,
                       resuming=resumes_into(plan.output_dir, config.training.resume_from))
        except OutputRefused as exc:
            return fail(str(exc))
    if (world > 1 or nodes) and not dry_run:
        return launch(config_path, overrides=overrides, nproc=nproc, overwrite=overwrite, nodes=nodes)
    from soup_core.run import dist_env

    rank, _ = dist_env()
    if rank != 0:  # under torchrun, rank 0 speaks for the run
        console.quiet = True
    console.print(f"[bold]soup train[/] {escape(str(config_path))}: task [cyan]{config.task}[/], backend "
                  f"[cyan]{config.backend}[/], base [cyan]{escape(config.base)}[/]")
    for line in plan.lines:
        console.print("  " + escape(line))
    for plugin, report in plan.preflight:
        if report.title:
            console.print(f"  [bold]{escape(report.title)}[/] ({plugin})")
        for line in report.lines:
            console.print("    " + escape(line))
    console.print(f"  output: {escape(str(plan.output_dir))}")
    if dry_run:
        try:
            console.print("  " + escape(token_length_summary(config, plan, plugins=plugins)))
        except DataError as exc:
            return fail(str(exc) + (f"\n  fix: {exc.fix}" if exc.fix else ""))
        except ValueError as exc:  # the task cannot encode a row (sft's EncodingError): says which and why
            return fail(str(exc))
        console.print("[green]Dry run passed:[/] config, plugins, probes and data are valid. No model was loaded.")
        return 0
    from soup_core.interrupts import RunInterrupted, interruptible
    from soup_core.outputs import OutputRefused

    try:
        with interruptible(then_leave=True):
            summary = execute(plan, plugins=plugins, report=lambda m: console.print(escape(m)),
                              run_id=os.environ.get(RUN_ID_ENV) or None, overwrite=overwrite, on_claim=kept.attach)
    except OutputRefused as exc:
        return fail(str(exc)) if rank == 0 else 1  # global rank 0 says it, once
    except KeyboardInterrupt as exc:
        if rank != 0:
            return exc.exit_code if isinstance(exc, RunInterrupted) else 130
        code = _interrupted(exc, config_path, overrides, plan)
        _said_last(exc)
        return code
    except DataError as exc:  # found once the tokenizer encoded the rows; the tracker row holds it too
        code = fail(str(exc) + (f"\n  fix: {exc.fix}" if exc.fix else ""))
        _said_last(exc)
        return code
    except Exception as exc:  # noqa: BLE001 - the tracker row already holds the failure
        if "--debug" in sys.argv or os.environ.get("SOUP_DEBUG") == "1":
            raise
        code = fail(f"run failed: {exc} (set SOUP_DEBUG=1 for the traceback)")
        _said_last(exc)
        return code
    if summary.get("stop_failed"):  # the watchdog stopped a run that went wrong: the row says stopped
        return fail(f"run {summary.get('run_id')} stopped: {summary.get('stop_reason')}")
    console.print(f"[green]Done.[/] run {summary.get('run_id')} → {escape(str(plan.output_dir))}{_acted(summary)}")
    return 0


def _acted(summary: dict[str, Any]) -> str:
    """What controllers took out of the run (``Tracker.loss_summary``), for the Done line: never silent."""
    rows, updates = int(summary.get("rows_excluded") or 0), int(summary.get("updates_skipped") or 0)
    said = [f"{n} {what if n == 1 else plural} {done}" for n, what, plural, done in (
        (rows, "training row", "training rows", "excluded"), (updates, "update", "updates", "skipped")) if n]
    return f" ({', '.join(said)}: the run's output above names each)" if said else ""


#: training path -> the flag that sets it, to print the command that resumes a run as it was started
_FLAGS = {"training.learning_rate": "--lr", "training.epochs": "--epochs", "training.max_steps": "--max-steps",
          "training.batch_size": "--batch-size", "training.gradient_accumulation_steps": "--grad-accum",
          "output": "--output", "backend": "--backend", "experiment_name": "--name", "base": "--base",
          "data.train": "--data", "training.seed": "--seed"}


def resume_command(config_path: Path, overrides: dict[str, Any], checkpoint: Path | str) -> str:
    """The ``soup train`` command line that resumes this run from ``checkpoint``."""
    import shlex

    parts = ["soup", "train", "--config", str(config_path)]
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if os.environ.get(LAUNCH_ENV):  # as the launcher was started: --nproc, and --nnodes and the rendezvous
        parts += json.loads(os.environ[LAUNCH_ENV])
    elif world > 1:
        parts += ["--nproc", str(world)]
    for path, value in overrides.items():
        if path in _FLAGS:
            parts += [_FLAGS[path], str(value)]
        elif path == "training.stream_allow_oom_attempt" and value:
            parts.append("--allow-oom-attempt")
    parts += ["--resume", str(checkpoint)]
    return shlex.join(parts)


def _interrupted(exc: KeyboardInterrupt, config_path: Path, overrides: dict[str, Any], plan: Any) -> int:
    """Say how the run was interrupted and the exact command that resumes it; return the exit code."""
    from soup_core.interrupts import RunInterrupted
    from soup_core.ui import err_console

    signum_name = exc.signal_name if isinstance(exc, RunInterrupted) else "SIGINT"
    checkpoint = exc.checkpoint if isinstance(exc, RunInterrupted) else None
    code = exc.exit_code if isinstance(exc, RunInterrupted) else 130
    if checkpoint is not None:
        err_console.print(f"Interrupted ({signum_name}) at step {exc.step}; checkpoint saved to {checkpoint}; "
                          "the run is recorded as interrupted.", markup=False, highlight=False, soft_wrap=True)
        err_console.print("Resume with: " + resume_command(config_path, overrides, checkpoint),
                          markup=False, highlight=False, soft_wrap=True)
        return code
    from soup_core.checkpoints import newest_checkpoint

    last = newest_checkpoint(plan.output_dir)
    err_console.print(f"Interrupted ({signum_name}) before a step could be checkpointed; the run is recorded "
                      "as interrupted.", markup=False, highlight=False, soft_wrap=True)
    if last is not None:
        err_console.print("Resume from its last checkpoint with: " + resume_command(config_path, overrides, last),
                          markup=False, highlight=False, soft_wrap=True)
    return code


@contextlib.contextmanager
def _world_size(n: int | None) -> Iterator[None]:
    """``WORLD_SIZE=n`` while the block runs (nothing when ``n`` is None)."""
    if n is None:
        yield
        return
    before = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(n)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = before


def launch(config_path: Path, *, overrides: dict[str, Any], nproc: int, overwrite: bool = False,
           nodes: dict[str, Any] | None = None) -> int:
    """Run ``soup train`` on ``nproc`` local processes (this machine's share of ``nodes``: ``nnodes``,
    ``node_rank``, ``endpoint``, ``rdzv_id``); returns the exit code of the group."""
    from soup_core.tracker import new_run_id

    env = dict(os.environ)
    env[OVERRIDES_ENV] = json.dumps(overrides)
    env.setdefault("OMP_NUM_THREADS", "1")
    flags = ["--nproc", str(nproc)]
    if nodes:  # global rank 0 (the rendezvous picks it, not --node-rank 0) names the run and tells the others
        where = [f"--nnodes={nodes['nnodes']}", f"--node-rank={nodes['node_rank']}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={nodes['endpoint']}", f"--rdzv-id={nodes['rdzv_id']}"]
        flags += ["--nnodes", str(nodes["nnodes"]), "--node-rank", str(nodes["node_rank"]),
                  "--rdzv-endpoint", str(nodes["endpoint"]), "--rdzv-id", str(nodes["rdzv_id"])]
        said = (f"Launching node {nodes['node_rank']} of {nodes['nnodes']}: {nproc} processes (torchrun "
                f"rendezvous {nodes['rdzv_id']} at {nodes['endpoint']}; the run id is global rank 0's)")
    else:
        env[RUN_ID_ENV] = env.get(RUN_ID_ENV) or new_run_id()
        where, said = ["--standalone"], f"Launching {nproc} processes (torchrun, run {env[RUN_ID_ENV]})"
    env[LAUNCH_ENV] = json.dumps(flags)
    import tempfile

    named = Path(tempfile.mkdtemp(prefix="soup-launch-")) / "run_id"  # where global rank 0 writes the run id
    env[RUN_ID_FILE_ENV] = str(named)
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={nproc}",
           "-m", "soup_core", "train", "--config", str(config_path), *(["--overwrite"] if overwrite else [])]
    print(said, flush=True)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
    got: list[int] = []
    relay = threading.Thread(target=_relay_stderr, args=(proc.stderr, got), daemon=True)
    relay.start()

    def forward(signum: int, frame: Any) -> None:
        # a scheduler signals the launcher: torchrun passes it on to the ranks, which checkpoint and stop
        got.append(signum)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    import signal

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # Ctrl-C reached every process of the group: wait for the ranks' save
                got.append(signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
    relay.join(timeout=10)
    if code and not got:
        _record_failure(env.get(RUN_ID_ENV) or (named.read_text().strip() if named.is_file() else ""), code)
    named.unlink(missing_ok=True)
    named.parent.rmdir()
    return 128 + got[0] if got else code


def _record_failure(run_id: str, code: int) -> None:
    """A run whose processes failed without a signal to this launcher is recorded ``failed``, whatever a rank
    managed to record: when a rank dies, torchrun stops the others with SIGTERM, which they take for a
    pre-emption (``interrupted``), and a rank killed outright leaves its row ``running`` (read: crashed)."""
    from soup_core.tracker import Tracker

    if not run_id:
        return  # global rank 0 ran on another machine: its launcher records it
    with Tracker() as tracker:
        row = tracker.get_run(run_id)
        if row is not None and row.status in ("running", "crashed", "interrupted"):
            tracker.finish_run(run_id, "failed", error=f"a process of the run died or failed (torchrun exit code "
                               f"{code}); the others were stopped")
            print(f"run {run_id} failed: a process of the run died or failed; the others were stopped, and the "
                  "run is recorded as failed", file=sys.stderr, flush=True)


#: torchrun's note that c10d numbers the processes itself: --node-rank names the machine, as docs/distributed.md says
_TORCHRUN_NOISE = ("node_rank is only used for static rdzv_backend",)


def _relay_stderr(stream: Any, got: list[int]) -> None:
    """Pass torchrun's stderr (the ranks' too) through, except torchrun's own traceback for the signal the
    launcher forwarded: the ranks already said what happened and how to resume."""
    skipping = False
    for line in stream:
        if got and line.startswith("Traceback (most recent call last)"):
            skipping = True
        if not skipping and not line.startswith(_TORCHRUN_NOISE):
            sys.stderr.write(line)
            sys.stderr.flush()
        elif "SignalException" in line and not line.startswith(" "):
            skipping = False


def token_length_summary(config: Any, plan: Any, *, plugins: Any) -> str:
    """One line on the training rows' token lengths as the task encodes them (loads the tokenizer only,
    never the model); says why when it cannot."""
    training = plan.data.get("train")
    task = plugins.tasks[config.task]()
    if training is None or not hasattr(task, "encode"):
        return "token lengths: not reported by this task"
    try:
        from soup_core.default_plugins.transformers.checks import load_tokenizer

        tokenizer = load_tokenizer(str(config.base))
    except Exception as exc:  # noqa: BLE001 - a dry run reports, it does not fail, on a missing tokenizer
        return f"token lengths: skipped (no local tokenizer for {config.base!r}: {type(exc).__name__})"
    from soup_core.data import check_supervision
    from soup_core.default_plugins import chat_templates
    from soup_core.default_plugins.prepared import cacheable, length_summary
    from soup_core.progress import RowProgress
    from soup_core.ui import console

    chat_templates.apply(tokenizer, config)
    if cacheable(task):  # the dry run fills the data cache that soup train then reads
        return length_summary(task, training, tokenizer, config, report=console.print)
    rows = RowProgress(training.rows, what="tokenising the training rows", report=console.print)
    encoded = task.encode(rows, tokenizer, config)
    lengths = sorted(len(e["input_ids"]) for e in encoded)
    if not lengths:
        return "token lengths: no rows"
    limit = int(config.data.max_length)
    skipped = check_supervision(encoded, training=training, max_length=limit,
                                on_bad_row=str(config.data.on_bad_row))
    cut = sum(1 for n in lengths if n >= limit)
    median = lengths[len(lengths) // 2]
    line = (f"token lengths: min {lengths[0]}, median {median}, max {lengths[-1]}; "
            f"{cut} of {len(lengths)} rows at data.max_length={limit} (truncated)")
    return line + (f"; {len(skipped)} rows skipped (no supervised token left)" if skipped else "")
