"""``soup train`` with task weighted_sft, end to end on the tiny model, as a user runs it (a subprocess that
finds the plugin through its entry point): the dry run, then a real run whose per-row losses reach recorders
(what ``soup rewind`` reads) for every training row, once per epoch."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from soup_core import Tracker
from soup_core.testing import make_distribution, run_soup

pytestmark = pytest.mark.slow

SRC = Path(__file__).resolve().parents[1] / "src"

#: A recorder plugin, installed beside the example for the test: it writes every micro-batch event to a file.
KEEP_EVENTS = """
import json, os
from soup_core import Recorder, hookimpl

SOUP_HOOK_API = (1, 1)


class KeepEvents(Recorder):
    name = "keep_events"

    def on_micro_batch(self, event):
        with open(os.environ["KEEP_EVENTS"], "a", encoding="utf-8") as out:
            out.write(json.dumps({"step": event.step, "rows": list(event.rows), "loss": list(event.row_loss),
                                  "tokens": list(event.row_tokens)}) + "\\n")


@hookimpl
def soup_register_recorders():
    return [KeepEvents]
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site folder whose distribution provides the ``example`` entry point (the plugin under test, from
    this checkout) and the recorder."""
    root = tmp_path_factory.mktemp("site")
    make_distribution(root, "example-under-test", entry_points={
        "example": "soup_plugin_example.plugin", "keep_events": "keep_events_plugin"},
        modules={"keep_events_plugin.py": KEEP_EVENTS})
    return root


def weighted_rows(n: int) -> list[dict[str, Any]]:
    """prompt/completion rows naming their index, with weights cycling 0, 0.5, 1, 2."""
    return [
        {"prompt": f"row {i}: what is {i} plus {i}?", "completion": f"it is {2 * i}" + "!" * (i % 3),
         "weight": (0, 0.5, 1, 2)[i % 4]}
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _soup(args: list[str], site: Path, events: Path):
    env = {"SOUP_LOAD_PLUGINS": "example,keep_events", "KEEP_EVENTS": str(events), "OMP_NUM_THREADS": "1"}
    return run_soup(args, env=env, extra_path=[site, SRC], timeout=400)


def _config(tmp_path: Path, base: Path, extra: str = "") -> Path:
    data = write_jsonl(tmp_path / "rows.jsonl", weighted_rows(12))
    config = tmp_path / "soup.yaml"
    config.write_text(
        f"base: {base}\ntask: weighted_sft\noutput: {tmp_path / 'out'}\n"
        f"data:\n  train: {data}\n  max_length: 48\n"
        "training:\n  epochs: 2\n  batch_size: 4\n  logging_steps: 1\n  dtype: float32\n"
        "  learning_rate: 0.01\n  lora: {r: 4, alpha: 8}\n" + extra,
        encoding="utf-8",
    )
    return config


def test_dry_run_plans_with_the_weighted_format(tmp_path, tiny_model, site) -> None:
    proc = _soup(["train", "-c", str(_config(tmp_path, tiny_model)), "--dry-run"], site, tmp_path / "events")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "12 training rows" in proc.stdout and "format: weighted" in proc.stdout
    assert "No model was loaded" in proc.stdout
    assert not (tmp_path / "events").exists()


def test_trains_and_reports_every_rows_loss(tmp_path, tiny_model, site) -> None:
    events_file = tmp_path / "events.jsonl"
    config = _config(tmp_path, tiny_model, "  weighted_reduction: rows\n  weight_clip: 1.5\n")
    proc = _soup(["train", "-c", str(config)], site, events_file)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = Tracker().list_runs(limit=1)[0]
    assert run.status == "completed" and run.task == "weighted_sft"
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    events = [json.loads(line) for line in events_file.read_text(encoding="utf-8").splitlines()]
    assert [e["step"] for e in events] == [1, 2, 3, 4, 5, 6]  # 12 rows, batch 4, 2 epochs
    for epoch in (events[:3], events[3:]):  # every row once per epoch, each with a finite loss
        assert sorted(r for e in epoch for r in e["rows"]) == list(range(12))
    assert all(math.isfinite(loss) and tokens > 0
               for e in events for loss, tokens in zip(e["loss"], e["tokens"], strict=True))
