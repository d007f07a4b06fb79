"""Out of memory for real: a process memory limit (RLIMIT_AS) that a batch of 1 trains under and a batch of 32
long rows does not; ``soup why`` says host memory, the step, and halves training.batch_size. The batch of 1
under the same limit is the control (it completes)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is Linux's")]

LIMIT_MB = 2500  # the tiny run needs about 2 GB of address space (torch's libraries); 32 long rows need more


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_MB << 20, LIMIT_MB << 20))


def test_out_of_memory_under_a_process_limit(helpers: Any, tiny_model: Path, tmp_path: Path) -> None:
    from soup_core.testing import write_jsonl, write_yaml

    rows = [{"messages": [{"role": "user", "content": "q " * 10}, {"role": "assistant", "content": "answer " * 900}]}
            for _ in range(32)]
    write_jsonl(tmp_path / "long.jsonl", rows)
    config = write_yaml(tmp_path / "soup.yaml", {
        "base": str(tiny_model), "output": str(tmp_path / "out"), "data": {"train": "long.jsonl", "max_length": 2048},
        "training": {"max_steps": 1, "logging_steps": 1, "lora": {"r": 0}}})
    home = tmp_path / "home"
    results = {}
    for batch in (1, 32):
        proc = helpers.soup_process(["train", "-c", str(config), "--batch-size", str(batch), "--overwrite"], home,
                                    preexec_fn=_limit)
        out, err = proc.communicate(timeout=300)
        results[batch] = (proc.returncode, helpers.verdict("latest", home), err)
    code, small, err = results[1]
    assert code == 0 and small.status == "completed", err  # control: the limit leaves room for a batch of 1
    code, big, err = results[32]
    assert code == 1 and "can't allocate memory" in err.lower() + big.evidence[0]["text"].lower()
    assert big.kind == "out_of_memory" and big.headline == "ran out of host memory in a step (step 1)"
    assert (big.key, big.value) == ("training.batch_size", 16) and "--dry-run" in big.fix
