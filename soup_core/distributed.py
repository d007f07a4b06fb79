"""``soup train --nproc N``: launch N training processes through torchrun (DDP); nothing home-made.

The launcher picks the run id, so every rank records events under the same run; rank 0 owns the tracker
row and the outputs. The same thing by hand::

    SOUP_RUN_ID=$(python -c "from soup_core.tracker import new_run_id; print(new_run_id())") \\
    torchrun --standalone --nproc_per_node 2 -m soup_core train -c soup.yaml
    accelerate launch --num_processes 2 -m soup_core train -c soup.yaml

(without ``SOUP_RUN_ID`` the non-zero ranks record under the id ``unknown``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

OVERRIDES_ENV = "SOUP_CONFIG_OVERRIDES"
RUN_ID_ENV = "SOUP_RUN_ID"


def launch(config_path: Path, *, overrides: dict[str, Any], nproc: int) -> int:
    """Run ``soup train`` on ``nproc`` local processes; returns the exit code of the group."""
    from soup_core.tracker import new_run_id

    env = dict(os.environ)
    env[RUN_ID_ENV] = env.get(RUN_ID_ENV) or new_run_id()
    env[OVERRIDES_ENV] = json.dumps(overrides)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "soup_core", "train", "--config", str(config_path)]
    print(f"Launching {nproc} processes (torchrun, run {env[RUN_ID_ENV]})", flush=True)
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130


def env_overrides() -> dict[str, Any]:
    """Overrides the launcher passed to each rank (empty outside a ``--nproc`` launch)."""
    raw = os.environ.get(OVERRIDES_ENV)
    return json.loads(raw) if raw else {}


def env_run_id() -> str | None:
    return os.environ.get(RUN_ID_ENV) or None
