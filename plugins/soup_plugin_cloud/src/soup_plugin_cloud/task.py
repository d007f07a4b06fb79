"""The SkyPilot task for one ``soup train --cloud``: resources, the Soup install, the inputs, the run.

Every input is mounted under ``~/soup-job`` on each machine (the config file by its name, the data files and a
local base under ``inputs/``) and the run trains there with the paths the config names replaced (the
``SOUP_CONFIG_OVERRIDES`` variable ``soup train`` reads, as its own launcher passes overrides to its ranks).
Nothing from this machine's environment is copied into the task: only the files the run reads are mounted,
and the variables set are Soup's own. The output is ``~/soup-job/output`` on the machine's disk (the output
folder's lock takes hard links, which bucket mounts lack); with a store, it is copied there while the run
trains and when it ends, and pulled back before a run starts, which then resumes with ``--resume latest``.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JOB = "~/soup-job"
#: where a ``--cloud-store`` bucket is mounted on every machine
STORE_MOUNT = "/soup-store"
RDZV_PORT = 29500
SYNC_SECONDS = 600
#: the variable that skips the Soup install in ``setup`` (a machine image that has it, or a local test)
SKIP_INSTALL = "SOUP_CLOUD_SKIP_INSTALL"


@dataclass
class Plan:
    """What the task is made from."""

    name: str
    config_name: str  # the config file's name under ~/soup-job
    accelerator: str
    count: int
    nnodes: int = 1
    spot: bool = False
    store: str | None = None
    disk: int = 100
    packages: list[str] = field(default_factory=list)  # pip requirement strings
    mounts: dict[str, str] = field(default_factory=dict)  # path under ~/soup-job -> local absolute path
    overrides: dict[str, Any] = field(default_factory=dict)


def cluster_name(config_path: Path) -> str:
    """``soup-<config name>``, as SkyPilot names may be: lower-case letters, digits and dashes."""
    stem = re.sub(r"[^a-z0-9-]+", "-", config_path.stem.lower()).strip("-") or "run"
    return f"soup-{stem}"[:40].rstrip("-")


def setup_script(plan: Plan) -> str:
    install = shlex.join(["python3", "-m", "pip", "install", "--quiet", *plan.packages])
    return "\n".join([
        "set -euo pipefail",
        f'if [ "${{{SKIP_INSTALL}:-0}}" = 1 ]; then',
        f'  echo "soup: install skipped ({SKIP_INSTALL}=1)"',
        "else",
        f"  {install}",
        "fi",
        "",
    ])


def run_script(plan: Plan) -> str:
    train = ["soup", "train", "--config", plan.config_name, "--nproc", "$SKYPILOT_NUM_GPUS_PER_NODE",
             "--nnodes", "$SKYPILOT_NUM_NODES", "--node-rank", "$SKYPILOT_NODE_RANK",
             "--rdzv-endpoint", '"$HEAD:$SOUP_RDZV_PORT"', "--rdzv-id", '"soup-$SKYPILOT_TASK_ID"']
    lines = [
        "set -euo pipefail",
        f"cd {JOB}",
        "# the head machine (the first of SKYPILOT_NODE_IPS) hosts the rendezvous",
        'HEAD=$(echo "$SKYPILOT_NODE_IPS" | head -n1)',
        "RESUME=()",
    ]
    if plan.store:
        lines += [
            "# what an earlier attempt copied to the store comes back first (a spot recovery, a rerun); its",
            "# lock belonged to a machine that is gone",
            'mkdir -p output "$SOUP_CLOUD_STORE"',
            'cp -a "$SOUP_CLOUD_STORE"/. output/',
            "rm -f output/.soup.lock output/.soup.lock.*",
        ]
    lines += [
        "# a checkpoint, or a run that completed, resumes (the latter: nothing to do, exit 0); an attempt that",
        "# stopped before its first checkpoint left only Soup's own files, which --overwrite replaces",
        "if ls -d output/checkpoint-* >/dev/null 2>&1 || grep -qs '\"status\": *\"completed\"' output/.soup_run.json",
        "then RESUME=(--resume latest); elif [ -f output/.soup_run.json ]; then RESUME=(--overwrite); fi",
    ]
    if plan.store:
        lines += [
            "# while it trains, and when it ends, the output goes to the store",
            "# (its sleep ends with it, and holds none of the job's output streams open)",
            f"( trap 'kill $nap 2>/dev/null; exit 0' TERM; while :; do sleep {SYNC_SECONDS} & nap=$!; wait $nap",
            '  cp -a output/. "$SOUP_CLOUD_STORE"/ || true; done ) >/dev/null 2>&1 &',
            "SYNC=$!",
            "status=0",
            " ".join(train) + ' ${RESUME[@]+"${RESUME[@]}"} || status=$?',
            'kill "$SYNC" 2>/dev/null || true',
            'cp -a output/. "$SOUP_CLOUD_STORE"/',
            'exit "$status"',
        ]
    else:
        lines += [" ".join(train) + ' ${RESUME[@]+"${RESUME[@]}"}']
    return "\n".join(lines) + "\n"


def task(plan: Plan) -> dict[str, Any]:
    """The task as SkyPilot's YAML reads it."""
    resources: dict[str, Any] = {"accelerators": f"{plan.accelerator}:{plan.count}", "disk_size": plan.disk}
    if plan.spot:
        resources["use_spot"] = True
    envs: dict[str, Any] = {
        "SOUP_CONFIG_OVERRIDES": json.dumps(plan.overrides, sort_keys=True),
        "SOUP_RDZV_PORT": str(RDZV_PORT),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    mounts: dict[str, Any] = {f"{JOB}/{where}": local for where, local in sorted(plan.mounts.items())}
    if plan.store:
        envs["SOUP_CLOUD_STORE"] = STORE_MOUNT
        mounts[STORE_MOUNT] = {"source": plan.store, "mode": "MOUNT"}
    return {"name": plan.name, "num_nodes": plan.nnodes, "resources": resources, "envs": envs,
            "file_mounts": mounts, "setup": setup_script(plan), "run": run_script(plan)}


def render(plan: Plan) -> str:
    """The task file's text: a header that says what made it, then the YAML."""
    import yaml

    class _Literal(str):
        pass

    class _Dumper(yaml.SafeDumper):
        pass

    _Dumper.add_representer(_Literal, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|"))
    data = task(plan)
    data["setup"], data["run"] = _Literal(data["setup"]), _Literal(data["run"])
    head = (f"# Written by `soup train --cloud` for {plan.config_name}: {plan.nnodes} machine(s) with "
            f"{plan.accelerator}:{plan.count} each.\n# Launch: {launch_command(plan, 'soup-sky.yaml')}\n")
    return head + yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


def launch_command(plan: Plan, path: str) -> str:
    if plan.spot:
        return shlex.join(["sky", "jobs", "launch", "-n", plan.name, path])
    return shlex.join(["sky", "launch", "-c", plan.name, path])
