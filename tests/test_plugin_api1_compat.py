"""A plugin written against hook API 1 keeps loading and training: the example plugin as it was before the
trainer seam ``SoupTrainerMixin.from_setup`` (``tests/fixtures/example_plugin_api1``, frozen), which builds
its trainer by hand (``RowCollator``, the constructor, ``soup_attach``), trains one short run, and every
training row's loss reaches the recorders."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from soup_core import Recorder, hookimpl

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parent / "fixtures" / "example_plugin_api1"


class _KeepEvents:
    """A plugin whose recorder keeps every micro-batch event in ``seen``."""

    SOUP_HOOK_API = (1, 1)

    def __init__(self) -> None:
        self.seen: list[Any] = []
        seen = self.seen

        class Keep(Recorder):
            name = "keep"

            def on_micro_batch(self, event: Any) -> None:
                seen.append(event)

        self.recorder = Keep

    @hookimpl
    def soup_register_recorders(self) -> list[type]:
        return [self.recorder]


@pytest.fixture
def api1_plugin(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(FIXTURE))
    import soup_plugin_example_api1.plugin as plugin

    return plugin


def test_the_frozen_api1_example_loads(api1_plugin) -> None:
    from soup_core.testing import isolated_plugins

    plugins = isolated_plugins(("example_api1", api1_plugin))
    assert plugins.plugins["example_api1"].status == "ok"
    assert "weighted_sft" in plugins.tasks and "weighted" in plugins.data_formats


def test_the_frozen_api1_example_trains(api1_plugin, tmp_path: Path, tiny_model_dir: Path) -> None:
    from soup_core.config import validate_config
    from soup_core.run import execute, plan_run
    from soup_core.testing import isolated_plugins

    rows = [{"prompt": f"row {i}: {i} plus {i}?", "completion": f"it is {2 * i}", "weight": (0.5, 1, 2)[i % 3]}
            for i in range(8)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    events = _KeepEvents()
    plugins = isolated_plugins(("example_api1", api1_plugin), ("keep_events", events))
    config = validate_config(
        {"base": str(tiny_model_dir), "task": "weighted_sft", "output": str(tmp_path / "out"),
         "data": {"train": str(data), "max_length": 32},
         "training": {"epochs": 1, "batch_size": 4, "gradient_accumulation_steps": 2, "logging_steps": 1,
                      "weighted_reduction": "rows", "lora": {"r": 4, "alpha": 8}}},
        plugins=plugins,
    )
    summary = execute(plan_run(config, plugins=plugins), plugins=plugins, report=lambda message: None)
    assert summary["status"] == "completed" and summary["steps"] == 1
    assert math.isfinite(summary["final_loss"])
    assert [(e.step, e.micro) for e in events.seen] == [(1, 0), (1, 1)]
    assert sorted(r for e in events.seen for r in e.rows) == list(range(8))
    assert all(math.isfinite(loss) and tokens > 0 for e in events.seen
               for loss, tokens in zip(e.row_loss, e.row_tokens, strict=True))
