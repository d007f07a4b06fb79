"""``soup train --cloud``: check the flags and the config, size the machines, write ``soup-sky.yaml`` next to
the config, print the command that launches it; with ``--cloud-submit``, launch it through SkyPilot and record
the run. Reads the config and the base's ``config.json``; never the environment's credentials. No torch."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from soup_plugin_cloud import accelerators as acc
from soup_plugin_cloud.task import JOB, Plan, cluster_name, launch_command, render

TASK_FILE = "soup-sky.yaml"
PIP_LINE = "pip install 'soup-core[cloud]'"
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,38}[a-z0-9]$")
_STORE = re.compile(r"^[a-z0-9]+://\S+$")


class Refused(Exception):
    """One message and an exit code: 2 for flags that do not go together, 1 for a config or input problem."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def say(line: str) -> None:
    print(line, flush=True)


def print_error(message: str) -> None:
    """One plain message on stderr, as every soup command says an error."""
    print(f"error: {message}", file=sys.stderr, flush=True)


def train_elsewhere(config_path: Path, options: dict[str, Any]) -> int:
    try:
        plan, lines = make_plan(config_path, options)
        if options.get("submit") and importlib.util.find_spec("sky") is None:
            raise Refused(f"--cloud-submit launches through SkyPilot, which is not installed: {PIP_LINE} (and "
                          "set up its cloud credentials: sky check); or drop --cloud-submit and launch the "
                          "written task yourself")
        path = config_path.resolve().parent / TASK_FILE
        _write(path, render(plan))
    except Refused as exc:
        print_error(str(exc))
        return exc.code
    for line in [f"Wrote {path}", *lines]:
        say(line)
    command = launch_command(plan, str(path))
    if not options.get("submit"):
        say(f"Nothing was launched. Launch with:\n  {command}")
        return 0
    return submit(plan, path, command, config_path)


def make_plan(config_path: Path, options: dict[str, Any]) -> tuple[Plan, list[str]]:
    """The task's plan and the lines that explain it; raises :class:`Refused`."""
    if not options.get("cloud"):
        raise Refused("--gpus, --spot, --cloud-name and --cloud-store go with --cloud (or --cloud-submit)", 2)
    if int(options.get("nproc") or 1) != 1 or options.get("node_flags"):
        raise Refused("--cloud starts one process per GPU on every machine itself: drop --nproc, --node-rank, "
                      "--rdzv-endpoint and --rdzv-id, and give the GPUs per machine with --gpus NAME:N", 2)
    overrides = dict(options.get("overrides") or {})
    if "training.resume_from" in overrides or options.get("overwrite"):
        raise Refused("--cloud decides itself: it resumes from what --cloud-store holds (--resume latest), and "
                      "replaces an attempt that stopped before its first checkpoint; drop --resume and --overwrite "
                      "(empty the store to start over)", 2)
    store = options.get("store")
    if store and not _STORE.match(store):
        raise Refused(f"--cloud-store {store!r}: give a bucket URI (s3://bucket/path, gs://..., r2://...)", 2)
    if options.get("spot") and not store:
        raise Refused("--spot needs --cloud-store URI: a pre-empted machine's disk goes with it, and the "
                      "checkpoints the job resumes from must be somewhere else", 2)
    name = options.get("name") or cluster_name(config_path)
    if not _NAME.match(name):
        raise Refused(f"--cloud-name {name!r}: use 2 to 40 lower-case letters, digits and dashes, starting "
                      "with a letter", 2)
    gpus = options.get("gpus")
    wanted = acc.parse_gpus(gpus) if gpus else None
    if gpus and wanted is None:
        raise Refused(f"--gpus {gpus!r}: give NAME or NAME:COUNT, such as A100:8 or L4", 2)
    if not config_path.is_file():
        raise Refused(f"{config_path}: no such config file. Write one with `soup init`, or pass --config PATH.")
    from soup_core import ConfigError, load_config, load_plugins

    plugins = load_plugins()
    try:
        config = load_config(config_path, plugins=plugins, overrides=overrides)
    except ConfigError as exc:
        raise Refused(exc.render()) from None
    folder = config_path.resolve().parent
    nnodes = int(options.get("nnodes") or 1)
    plan = Plan(name=name, config_name=config_path.name, accelerator="", count=0, nnodes=nnodes,
                spot=bool(options.get("spot")), store=store)
    plan.mounts[config_path.name] = str(config_path.resolve())
    plan.overrides = {k: v for k, v in overrides.items() if k not in ("output",)}
    plan.overrides["output"] = "output"
    data_bytes = _mount_data(config, plugins, folder, plan)
    base, model_bytes = _mount_base(str(config.base), folder, plan)
    lines = []
    shape = _shape(base)
    if wanted is not None:
        plan.accelerator, plan.count = wanted
        lines.append(f"GPUs: {plan.accelerator}:{plan.count} per machine (--gpus)")
        if shape is not None:
            need = acc.estimate(shape, config, devices=plan.count * nnodes)
            lines.append(f"  the estimate: {acc.gb(need.total)} per device ({_parts(need)})")
    else:
        if shape is None:
            raise Refused(f"--cloud cannot size the GPUs: no config.json for the base {config.base!r} here (a "
                          "local folder or the Hugging Face cache); give them with --gpus NAME:N (A100:1)")
        chosen = acc.choose(shape, config, nnodes)
        if chosen is None:
            need = acc.estimate(shape, config, devices=8 * nnodes)
            raise Refused(f"the run needs {acc.gb(need.total)} per device ({_parts(need)}), more than 90% of the "
                          "largest GPU's 80 GB; set training.quantization: 4bit or training.sharding: fsdp, or "
                          "give the GPUs with --gpus NAME:N")
        plan.accelerator, plan.count, need = chosen
        memory = dict(acc.TABLE)[plan.accelerator]
        lines.append(f"GPUs: {plan.accelerator}:{plan.count} per machine, the smallest that fits the estimate "
                     f"{acc.gb(need.total)} per device ({_parts(need)}) in 90% of its {memory} GB")
    model_bytes = model_bytes or (shape.params() * 2 if shape is not None else 0)
    plan.disk = acc.disk_gb(model_bytes, data_bytes)
    plan.packages = packages(config, plugins, overrides, config_path)
    lines += [f"machines: {nnodes}" + (" (spot, a managed job that resumes after a pre-emption)" if plan.spot
                                         else ""), f"disk: {plan.disk} GB per machine",
              f"installs: {' '.join(plan.packages)}",
              f"mounted: {', '.join(sorted(plan.mounts))} (under {JOB})",
              f"output: {JOB}/output on each machine's disk" + (
                  f", copied to {store} while it trains and when it ends" if store else
                  f"; fetch it with: rsync -Pavz {name}:{JOB}/output/ ./{name}-output/")]
    return plan, lines


def _parts(need: acc.Estimate) -> str:
    return ", ".join(f"{part} {acc.gb(n)}" for part, n in need.parts.items())


def _shape(base: str) -> acc.Shape | None:
    data = acc.read_model_config(base)
    try:
        return acc.Shape.from_config(data) if data is not None else None
    except (KeyError, ValueError, TypeError):
        return None


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _mount_data(config: Any, plugins: Any, folder: Path, plan: Plan) -> int:
    """Mount every data file the task reads under ``inputs/<key>/``; the config then names them there."""
    task_cls = plugins.tasks.get(config.task)
    keys = [*getattr(task_cls, "data_keys", ("data.train",)), *getattr(task_cls, "optional_data_keys", ())]
    total = 0
    for dotted in keys:
        key = dotted.split(".", 1)[1]
        raw = getattr(config.data, key, None)
        if raw in (None, "", []):
            continue
        entries = raw if isinstance(raw, list) else [raw]
        mapped: list[Any] = []
        for i, entry in enumerate(entries):
            written = entry if isinstance(entry, str) else entry.get("path")
            local = Path(os.path.expanduser(str(written)))
            local = local if local.is_absolute() else folder / local
            if not local.is_file():
                raise Refused(f"{dotted}: {written!r} is no file ({local}); the cloud machines get the data files "
                              "this config names, so each must exist here")
            where = f"inputs/{key}/{i}-{local.name}"
            plan.mounts[where] = str(local.resolve())
            total += local.stat().st_size
            mapped.append(where if isinstance(entry, str) else {**entry, "path": where})
        plan.overrides[dotted] = mapped if isinstance(raw, list) else mapped[0]
    return total


def _mount_base(base: str, folder: Path, plan: Plan) -> tuple[str, int]:
    """A base that is a local folder or file is mounted under ``inputs/base/``; a hub id is downloaded there."""
    local = Path(os.path.expanduser(base))
    local = local if local.is_absolute() else folder / local
    if not (base.startswith(("./", "../", "/", "~")) or local.exists()):
        return base, 0  # a hub id
    if not local.exists():
        raise Refused(f"base: {base!r} is no file or folder ({local}); give a local model or a hub id")
    where = f"inputs/base/{local.name}"
    plan.mounts[where] = str(local.resolve())
    plan.overrides["base"] = where
    return str(local), _size(local)


def packages(config: Any, plugins: Any, overrides: dict[str, Any], config_path: Path) -> list[str]:
    """The Soup distributions this run needs, at the versions installed here: soup-core with its training
    extras, and the distribution of each plugin that provides the task, the backend or a field the config sets."""
    import yaml

    extras = "train,quant" if str(config.training.quantization) != "none" else "train"
    out = [f"soup-core[{extras}]=={importlib.metadata.version('soup-core')}"]
    owners = {plugins.tasks.owner(config.task), plugins.backends.owner(config.backend)}
    try:
        written = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        written = {}
    used = set(overrides) | set(_paths(written))
    owners |= {plugins.config_fields.owner(path) for path in plugins.config_fields if path in used}
    for owner in sorted(owners):
        info = plugins.plugins.get(owner)
        if info is not None and not info.builtin and info.distribution != "soup-core":
            line = f"{info.distribution}=={info.version}"
            if line not in out:
                out.append(line)
    return out


def _paths(data: Any, prefix: str = "") -> list[str]:
    if not isinstance(data, dict):
        return [prefix] if prefix else []
    return [p for k, v in data.items() for p in _paths(v, f"{prefix}.{k}" if prefix else str(k))] + (
        [prefix] if prefix else [])


def _write(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file, then a rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def submit(plan: Plan, path: Path, command: str, config_path: Path) -> int:
    """Launch the written task through SkyPilot's Python API (its own credentials, never read here) and record
    the run as ``submitted``."""
    import sky

    try:
        task = sky.Task.from_yaml(str(path))
        request = (sky.jobs.launch(task, name=plan.name) if plan.spot
                   else sky.launch(task, cluster_name=plan.name))
        sky.stream_and_get(request)
    except Exception as exc:  # noqa: BLE001 - SkyPilot's own message says what is missing (credentials, quota)
        print_error(f"SkyPilot could not launch {path}: {type(exc).__name__}: {exc} (sky check says which "
                    f"clouds are set up); the task is written, launch it by hand with: {command}")
        return 1
    run_id = record(plan, command, config_path)
    say(f"Submitted {'managed job' if plan.spot else 'cluster'} {plan.name}; recorded as run {run_id} "
        f"(soup runs show {run_id}). Follow it with: "
        + (f"sky jobs logs -n {plan.name}" if plan.spot else f"sky logs {plan.name}"))
    return 0


def record(plan: Plan, command: str, config_path: Path) -> str:
    """One tracker row for the submitted run: ``submitted``, on ``sky:NAME``, with the command."""
    from soup_core import Tracker, load_config, load_plugins

    config = load_config(config_path, plugins=load_plugins())
    where = plan.store or f"{plan.name}:{JOB}/output"
    with Tracker() as tracker:
        run_id = tracker.start_run(name=config.experiment_name, task=config.task, backend=config.backend,
                                   base_model=str(config.base), config=config.model_dump(mode="json"),
                                   output_dir=where, submitted_to=f"sky:{plan.name}")
        tracker.update_summary(run_id, {"cloud": "managed job" if plan.spot else "cluster",
                                        "cloud_name": plan.name, "cloud_command": command,
                                        "cloud_task": str(path_of(config_path))})
    return run_id


def path_of(config_path: Path) -> Path:
    return config_path.resolve().parent / TASK_FILE
