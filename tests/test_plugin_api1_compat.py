"""A plugin written against hook API 1 keeps loading and training: the example plugin as it was before the
trainer seam ``SoupTrainerMixin.from_setup`` (``tests/fixtures/example_plugin_api1``, frozen), which builds
its trainer by hand (``RowCollator``, the constructor, ``soup_attach``), trains one short run, and every
training row's loss reaches the recorders. It imports the trainer seam from ``soup_core`` by the names that
have since moved to the default plugins, so each of them now warns once (docs/plugins.md, "Migration")."""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import soup_core
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
    for name in [m for m in sys.modules if m.split(".")[0] == "soup_plugin_example_api1"]:
        monkeypatch.delitem(sys.modules, name)  # imported afresh, so its module-level imports run in the test
    import soup_plugin_example_api1.plugin as plugin

    return plugin


@pytest.fixture
def deprecated_names(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], list[str]]]:
    """A function returning the old ``soup_core`` names used so far in the test, one entry per warning."""
    monkeypatch.setattr(soup_core, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield lambda: [str(w.message).split()[0].removeprefix("soup_core.") for w in caught
                       if issubclass(w.category, DeprecationWarning) and str(w.message).startswith("soup_core.")]


# the names this plugin imports from soup_core that now live in soup_core.default_plugins
MOVED_NAMES = ["HONOURED_FIELDS", "RowCollator", "SoupTrainerMixin", "TrainerSetup", "datasets_for", "encode_rows"]


def test_the_frozen_api1_example_loads(api1_plugin, deprecated_names) -> None:
    from soup_core.testing import isolated_plugins

    plugins = isolated_plugins(("example_api1", api1_plugin))
    assert plugins.plugins["example_api1"].status == "ok"
    assert "weighted_sft" in plugins.tasks and "weighted" in plugins.data_formats
    assert deprecated_names() == ["HONOURED_FIELDS"]  # its support row names the (transformers, sft) fields


def test_control_the_current_example_loads_without_a_deprecation(deprecated_names) -> None:
    import soup_plugin_example.plugin as current
    from soup_core.testing import isolated_plugins

    assert isolated_plugins(("example", current)).plugins["example"].status == "ok"
    assert deprecated_names() == []


def test_the_frozen_api1_example_trains(api1_plugin, deprecated_names, tmp_path: Path, tiny_model_dir: Path) -> None:
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
    assert sorted(deprecated_names()) == MOVED_NAMES
