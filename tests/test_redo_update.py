"""A step redone without rows (``SkipUpdate(redo_without=rows)``, the spike guard's quarantine): the transformers
backend runs the step's micro-batches again with the rows masked and applies that update. The run then ends on
exactly the weights of a run that left the rows out from the start, on the same batches (LoRA with dropout,
two accumulated micro-batches a step: the redo replays the step's random state and token count). Controls: the
plain skip (the old quarantine) ends elsewhere; a step whose every row is named is skipped; and the rewind log
holds the step's micro-batches once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from soup_core import hookimpl
from soup_core.testing import write_jsonl

pytest_plugins = ["soup_core.testing"]

BATCH, ACCUMULATE, SEED = 2, 2, 42
AT = 2  # the step the controller acts at


class _Act:
    """A plugin whose controller, at step ``AT``, excludes ``rows`` (``ExcludeRows``) and asks the step redone
    without them (``redo``) or plainly skipped; with ``at_start`` it excludes them from the first step instead."""

    SOUP_HOOK_API = (1, 1)

    def __init__(self, rows: tuple[int, ...], *, redo: bool = True, at_start: bool = False) -> None:
        from soup_core.contracts import Controller, ExcludeRows, SkipUpdate

        class Act(Controller):
            name = "act"

            def on_run_start(self, event: Any) -> Any:
                return (ExcludeRows(rows, "out from the start"),) if at_start else ()

            def before_update(self, event: Any) -> Any:
                if at_start or event.step != AT:
                    return ()
                return (SkipUpdate("test: the rows spoil it", redo_without=rows if redo else ()),
                        ExcludeRows(rows, "test"))

        self.controller = Act

    @hookimpl
    def soup_register_controllers(self) -> list[type]:
        return [self.controller]


@pytest.fixture(scope="module")
def data(tmp_path_factory: Any) -> Path:
    from soup_core.default_plugins.commands.quickstart import synthetic_rows

    return write_jsonl(tmp_path_factory.mktemp("redo") / "train.jsonl", synthetic_rows(poisoned_row=-1)[:12])


def _step_rows() -> list[list[int]]:
    """Each step's rows in epoch 1 (12 rows: 3 steps of 2 micro-batches of 2)."""
    from soup_core import micro_batches

    batches = micro_batches(12, batch_size=BATCH, epoch=0, seed=SEED)
    return [[r for mb in batches[i:i + ACCUMULATE] for r in mb] for i in range(0, len(batches), ACCUMULATE)]


def _config(data: Path) -> dict[str, Any]:
    return {
        "task": "sft",
        "data": {"train": str(data), "format": "chat", "val_split": 0.0, "max_length": 256, "seed": SEED},
        "training": {"max_steps": 6, "learning_rate": 5e-3, "batch_size": BATCH, "scheduler": "constant",
                     "gradient_accumulation_steps": ACCUMULATE, "dtype": "float32", "seed": 0,
                     "lora": {"r": 8, "dropout": 0.1}},
    }


def _weights(result: Any) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(result.output_dir / "adapter_model.safetensors"))


def _equal(a: dict[str, Any], b: dict[str, Any], torch: Any) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_redone_step_applies_the_update_of_a_run_without_the_row(run_training, data, torch_one_thread):
    torch = torch_one_thread
    steps = _step_rows()
    row = next(r for r in steps[AT - 1] if all(r not in s for s in steps[:AT - 1]))  # first met at step AT
    redone = run_training(_config(data), plugins=[("act", _Act((row,)))])
    masked = run_training(_config(data), plugins=[("act", _Act((row,), at_start=True))])
    skipped = run_training(_config(data), plugins=[("act", _Act((row,), redo=False))])

    [metrics] = [s.metrics for s in redone.steps if s.step == AT]
    assert metrics.get("update_redone") == 1.0 and "update_skipped" not in metrics
    assert f"step {AT}: computed again without row {row}, its update applied" in redone.output
    # the gradient norm is that of the step without the row, as the masked run measured it; the step's loss is
    # the one its rows met (the row's included, as the rewind log has it), as the skipping run reports it
    [theirs] = [s.metrics for s in masked.steps if s.step == AT]
    [met] = [s.metrics for s in skipped.steps if s.step == AT]
    assert metrics["grad_norm"] == theirs["grad_norm"] and metrics["loss"] == met["loss"] != theirs["loss"]
    assert _equal(_weights(redone), _weights(masked), torch)
    # the control, the old quarantine: the step skipped, the clean rows' part of it lost
    assert [s.step for s in skipped.steps if s.metrics.get("update_skipped")] == [AT]
    assert not _equal(_weights(skipped), _weights(masked), torch)
    # the step's micro-batches are reported once, with the row as it was met (rewind names it from there)
    at = [m for m in redone.micro if m.step == AT]
    assert len(at) == ACCUMULATE and sorted(r for m in at for r in m.rows) == sorted(steps[AT - 1])
    assert all(t > 0 for m in at for t in m.row_tokens)
    later = [m for m in redone.micro if m.step > AT and row in m.rows]
    assert later and all(m.row_tokens[m.rows.index(row)] == 0 for m in later)


def test_a_step_with_every_row_named_is_skipped(run_training, data, torch_one_thread):
    rows = tuple(_step_rows()[AT - 1])
    result = run_training(_config(data), plugins=[("act", _Act(rows))])
    [metrics] = [s.metrics for s in result.steps if s.step == AT]
    assert metrics.get("update_skipped") == 1.0 and "update_redone" not in metrics
    assert f"step {AT}: update skipped (test: the rows spoil it)" in result.output
