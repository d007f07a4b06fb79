"""The spike guard under gradient accumulation and packing (a step's rows over its micro-batches; an
excluded row masked inside a packed sequence, the other rows untouched) and across a resume (the quarantine
and the rule's history come back from the checkpoint's step: the resumed run ends on the same weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from soup_core import hookimpl
from soup_core.testing import write_jsonl

pytest_plugins = ["soup_core.testing"]
pytestmark = pytest.mark.slow


class _Watch:
    """A plugin whose controller keeps every PendingUpdate and excludes ``rows`` from the first step."""

    SOUP_HOOK_API = (1, 1)

    def __init__(self, rows: tuple[int, ...]) -> None:
        from soup_core.contracts import Controller, ExcludeRows

        self.pending: list[Any] = []
        pending = self.pending

        class Watch(Controller):
            name = "watch"
            wants_rows = True

            def on_run_start(self, event: Any) -> Any:
                return (ExcludeRows(rows),) if rows else ()

            def before_update(self, event: Any) -> Any:
                pending.append(event)
                return ()

        self.controller = Watch

    @hookimpl
    def soup_register_controllers(self) -> list[type]:
        return [self.controller]


def _config(data: Path, **training: Any) -> dict[str, Any]:
    return {
        "task": "sft",
        "data": {"train": str(data), "format": "chat", "val_split": 0.0, "max_length": 256},
        "training": {"learning_rate": 5e-3, "batch_size": 2, "scheduler": "constant", "dtype": "float32",
                     "lora": {"r": 0}, "seed": 0, **training},
    }


@pytest.mark.parametrize("packing", [False, True])
def test_accumulated_and_packed_steps_give_every_row_and_mask_only_the_excluded(run_training, tmp_path, packing):
    from soup_core.default_plugins.commands.quickstart import synthetic_rows

    data = write_jsonl(tmp_path / "train.jsonl", synthetic_rows()[:12])
    config = _config(data, max_steps=3, gradient_accumulation_steps=2)
    config["data"]["packing"] = packing
    watch, control = _Watch((5,)), _Watch(())
    result = run_training(config, plugins=[("watch", watch)])
    plain = run_training(config, plugins=[("watch", control)])
    for ran, seen in ((result, watch.pending), (plain, control.pending)):
        assert [p.step for p in seen] == [1, 2, 3]
        for p in seen:  # the step's rows are both micro-batches' rows, as the recorders saw them
            micro = [m for m in ran.micro if m.step == p.step]
            assert len(micro) == 2 and p.rows == tuple(r for m in micro for r in m.rows)
            assert p.row_tokens == tuple(t for m in micro for t in m.row_tokens)
    ours = {(m.step, r): t for m in result.micro for r, t in zip(m.rows, m.row_tokens, strict=True)}
    theirs = {(m.step, r): t for m in plain.micro for r, t in zip(m.rows, m.row_tokens, strict=True)}
    assert any(r == 5 for _, r in ours) and ours.keys() == theirs.keys()
    assert all(ours[k] == (0 if k[1] == 5 else theirs[k]) for k in ours)  # only row 5 lost its tokens
    assert all(theirs[k] > 0 for k in theirs)  # control: without the exclusion row 5 trains


def test_a_resumed_run_keeps_the_quarantine_and_ends_on_the_same_weights(run_training, tmp_path, torch_one_thread):
    torch = torch_one_thread
    from safetensors.torch import load_file

    from soup_core.default_plugins.commands.quickstart import POISONED_ROW, synthetic_rows

    data = write_jsonl(tmp_path / "train.jsonl", synthetic_rows())
    config = _config(data, epochs=5, batch_size=4, spike_guard="quarantine", save_steps=40)
    whole = run_training(config)
    records = [json.loads(x) for x in (whole.output_dir / "quarantine.jsonl").read_text().splitlines()]
    assert [r["row"] for r in records] == [POISONED_ROW] and records[0]["step"] < 40
    checkpoint = whole.output_dir / "checkpoint-40"
    assert checkpoint.is_dir()
    final = load_file(str(whole.output_dir / "model.safetensors"))

    resumed = run_training({**config, "output": str(whole.output_dir)},
                           overrides={"training.resume_from": str(checkpoint)})
    later = [m for m in resumed.micro if POISONED_ROW in m.rows]
    assert later and all(m.step > 40 and m.row_tokens[m.rows.index(POISONED_ROW)] == 0 for m in later)
    again = load_file(str(resumed.output_dir / "model.safetensors"))
    assert all(torch.equal(final[k], again[k]) for k in final)
    assert [json.loads(x) for x in (whole.output_dir / "quarantine.jsonl").read_text().splitlines()] == records

    # control: a resume that forgot the quarantine. The guard meets the row again at step 44 and redoes that
    # step without it, which ends on the same weights; with the guard off there the row trains, and they differ
    (whole.output_dir / "quarantine.jsonl").unlink()
    forgot = run_training({**config, "output": str(whole.output_dir)},
                          overrides={"training.resume_from": str(checkpoint), "training.spike_guard": "off"})
    assert any(m.row_tokens[m.rows.index(POISONED_ROW)] > 0 for m in forgot.micro if POISONED_ROW in m.rows)
    other = load_file(str(forgot.output_dir / "model.safetensors"))
    assert not all(torch.equal(final[k], other[k]) for k in final)


def test_two_processes_take_the_same_decision_as_one(run_training, tmp_path):
    """DDP (2 ranks x 2 rows = 1 process x 4 rows): the guard gathers both ranks' rows, quarantines the
    row at the step and share one process does, both ranks redo that step without it, and neither rank
    trains on it afterwards."""
    import yaml

    from soup_core.default_plugins.commands.quickstart import POISONED_ROW, synthetic_rows
    from soup_core.default_plugins.transformers.tiny import tiny_model_dir
    from soup_core.testing import run_soup
    from soup_plugin_rewind.logfile import read_log

    data = write_jsonl(tmp_path / "train.jsonl", synthetic_rows())
    one = run_training({**_config(data, batch_size=4, max_steps=33, spike_guard="quarantine")})
    [single] = [json.loads(x) for x in (one.output_dir / "quarantine.jsonl").read_text().splitlines()]

    config = _config(data, batch_size=2, max_steps=44, spike_guard="quarantine")  # row 17 again at step 44
    config.update(base=str(tiny_model_dir()), output=str(tmp_path / "ddp"))
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    proc = run_soup(["train", "-c", str(path), "--nproc", "2"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [both] = [json.loads(x) for x in (tmp_path / "ddp" / "quarantine.jsonl").read_text().splitlines()]
    assert (both["row"], both["step"]) == (POISONED_ROW, single["step"])
    assert abs(both["share"] - single["share"]) < 1e-5
    log = read_log(tmp_path / "ddp" / "rewind.jsonl")
    assert len(log.files) == 2 and [g["step"] for g in log.guards] == [single["step"]]
    assert [g["update"] for g in log.guards] == ["redone"]  # both ranks ran the step again, without the row
    later = [r for s in log.steps if s > single["step"] for r in log.step_rows(s) if r.row == POISONED_ROW]
    assert later and all(r.tokens == 0 for r in later)
