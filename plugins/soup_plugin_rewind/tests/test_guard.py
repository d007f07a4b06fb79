"""The spike guard (training.spike_guard): on three different poisoned rows, quarantine excludes that row and
no other, at or before the first step at which the unguarded run's rewind names it, and has that step redone
without it: a row caught at its first sighting leaves the run on exactly the weights of a run without the
row, and one that trained once before it was caught within 5% of it (the other rows' loss); skip vetoes the
spiking updates only; the online rule flags exactly the steps rewind's reading of the log does; and the
support table refuses the guard where it cannot act."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from soup_core import hookimpl
from soup_core.testing import write_jsonl
from soup_plugin_rewind.analysis import ADVICE_SHARE, MIN_HISTORY, SpikeRule, find_spikes, log_spikes, rank_rows
from soup_plugin_rewind.logfile import read_log

pytest_plugins = ["soup_core.testing"]


def test_the_online_rule_flags_exactly_what_find_spikes_flags():
    rng = random.Random(3)
    losses: list[float | None] = [2.0 + rng.random() for _ in range(200)]
    for i in (10, 57, 58, 120):
        losses[i] = 9.0
    losses[80], losses[90] = math.nan, None
    steps = list(range(1, 201))
    rule = SpikeRule()
    online = [s for step, loss in zip(steps, losses, strict=True) if (s := rule.check(step, loss))]
    offline = find_spikes(steps, losses)
    assert sorted(s.step for s in online) == sorted(s.step for s in offline) == [11, 58, 59, 81, 121]
    assert {s.step: s for s in online} == {s.step: s for s in offline}


def _poisoned(kind: str) -> tuple[list[dict[str, Any]], int]:
    """The quickstart's rows with one poisoned row: its own garbage (row 17), a long babble of made-up
    words (row 40) or a long run of capitals and brackets ("shouting", row 30)."""
    from soup_core.default_plugins.commands.quickstart import POISONED_ROW, synthetic_rows

    if kind == "quickstart":
        return synthetic_rows(), POISONED_ROW
    rows = synthetic_rows(poisoned_row=-1)  # clean; then a different poison at another place
    if kind == "babble":
        rng = random.Random(11)
        words = " ".join("".join(rng.choice("bcdfghlmnprstvz") + rng.choice("aeiou") for _ in range(3))
                         for _ in range(150))
        rows[40] = {"messages": [{"role": "user", "content": "Say something."},
                                 {"role": "assistant", "content": words}]}
        return rows, 40
    rng = random.Random(7)
    shouting = "".join(rng.choice("ABCDEFGHIJKLMNOPRSTUVWYZ[]{}<>|") for _ in range(600))
    rows[30] = {"messages": [{"role": "user", "content": "Shout the password."},
                             {"role": "assistant", "content": shouting}]}
    return rows, 30


def _config(data: Path, guard: str, base: Path | None = None, **training: Any) -> dict[str, Any]:
    # lr 2e-3 decaying linearly: here skipping any one update of the run without the row moves the others'
    # final loss by at most 3.5% (measured at 5 steps), so 5% can tell a guarded run from an unguarded one
    # (+9-10%); at a constant 5e-3 one skipped update alone moved it by up to 23%
    config: dict[str, Any] = {
        "task": "sft",
        "data": {"train": str(data), "format": "chat", "val_split": 0.0, "max_length": 256},
        "training": {"epochs": 12, "learning_rate": 2e-3, "batch_size": 4, "scheduler": "linear",
                     "dtype": "float32", "lora": {"r": 0}, "seed": 0, "spike_guard": guard, **training},
    }
    if base is not None:
        config["base"] = str(base)
    return config


_WARM: dict[str, Path] = {}


def _warm_base(run_training: Any, tmp_path_factory: Any) -> Path:
    """The tiny model after 4 epochs on other rows of the same task (the quickstart's generator, another
    seed): a base that knows the task already, as a real fine-tune's does. From the random model the clean
    rows' loss stays as high as a poison's for two epochs, so no step is a spike by rewind's rule before a
    poisoned row's third sighting, and it has trained twice by then. Built once per session."""
    if "base" not in _WARM:
        from soup_core.default_plugins.commands.quickstart import synthetic_rows

        data = write_jsonl(tmp_path_factory.mktemp("warm") / "warm.jsonl", synthetic_rows(poisoned_row=-1, seed=1))
        _WARM["base"] = run_training(_config(data, "off", epochs=4, learning_rate=5e-3)).output_dir
    return _WARM["base"]


class _DropRow:
    """A plugin whose controller excludes one row from the first step on."""

    SOUP_HOOK_API = (1, 1)

    def __init__(self, row: int) -> None:
        from soup_core.contracts import Controller, ExcludeRows

        class Drop(Controller):
            name = "drop-row"

            def on_run_start(self, event: Any) -> Any:
                return (ExcludeRows((row,), "removed"),)

        self.controller = Drop

    @hookimpl
    def soup_register_controllers(self) -> list[type]:
        return [self.controller]


def _mean_row_loss(model_dir: Path, rows: list[dict[str, Any]], torch: Any) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.sft import encode_rows
    from soup_core.default_plugins.transformers import row_sums

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    losses = []
    with torch.no_grad():
        for enc in encode_rows(rows, tok, max_length=256):
            ids, labels = torch.tensor([enc["input_ids"]]), torch.tensor([enc["labels"]])
            sums, counts = row_sums(model(input_ids=ids), 1, labels=labels)
            losses.append(float(sums[0] / counts[0]))
    return sum(losses) / len(losses)


@pytest.mark.slow
@pytest.mark.parametrize("poison", ["quickstart", "babble", "shouting"])
def test_quarantine_takes_the_poisoned_row_and_no_other(run_training, tmp_path, tmp_path_factory, poison,
                                                        torch_one_thread):
    base = _warm_base(run_training, tmp_path_factory)
    rows, bad = _poisoned(poison)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    plain = run_training(_config(data, "off", base))
    log = read_log(plain.output_dir / "rewind.jsonl")
    named = [s.step for s in sorted(log_spikes(log), key=lambda s: s.step)
             if (top := rank_rows(log.step_rows(s.step))[0]).row == bad and top.share >= ADVICE_SHARE]
    assert named, "the unguarded run's rewind does not name the poisoned row"

    seen = sorted({m.step for m in plain.micro if bad in m.rows})  # the steps that train the row

    guarded = run_training(_config(data, "quarantine", base))
    records = [json.loads(line) for line in (guarded.output_dir / "quarantine.jsonl").read_text().splitlines()]
    assert [(r["row"], r["file"], r["line"]) for r in records] == [(bad, str(data), bad + 1)]
    assert records[0]["step"] <= named[0] and records[0]["share"] >= ADVICE_SHARE
    later = [m for m in guarded.micro if m.step > records[0]["step"] and bad in m.rows]
    assert later and all(m.row_tokens[m.rows.index(bad)] == 0 for m in later)  # never trained on again
    guards = read_log(guarded.output_dir / "rewind.jsonl").guards
    assert guards and guards[0]["action"] == "quarantine" and guards[0]["rows"][0]["row"] == bad
    assert guards[0]["update"] == "redone"  # the step ran again without the row: its clean rows trained
    [acted] = [s.metrics for s in guarded.steps if s.step == records[0]["step"]]
    assert acted.get("update_redone") == 1.0 and "update_skipped" not in acted
    assert guarded.steps[-1].metrics["rows_excluded"] == 1.0
    if poison == "quickstart":  # soup rewind --json lists what the guard did at its spike
        from soup_core.testing import run_soup

        proc = run_soup(["rewind", str(guarded.output_dir), "--json", "r.json"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads((tmp_path / "r.json").read_text())
        assert report["guard"][0] == {"step": records[0]["step"], "action": "quarantine", "update": "redone",
                                      "rows": [{"row": bad, "share": records[0]["share"]}]}
        assert [s.get("guard") for s in report["spikes"] if s["step"] == records[0]["step"]] == ["quarantine"]
        assert f"quarantined row {bad}" in proc.stdout and "computed again without them" in proc.stdout

    # "that row removed": the same data and micro-batches with the row taking no part from the first step
    # (a file without it trains other batches, whose final losses differ by ~10% on their own)
    others = [r for i, r in enumerate(rows) if i != bad]
    clean = run_training(_config(data, "off", base), plugins=[("drop-row", _DropRow(bad))])
    torch = torch_one_thread
    ours, theirs = _mean_row_loss(guarded.output_dir, others, torch), _mean_row_loss(clean.output_dir, others, torch)
    unguarded = _mean_row_loss(plain.output_dir, others, torch)
    assert unguarded > ours  # the row cost the others something: the comparison is not vacuous
    assert abs(ours - theirs) < abs(unguarded - theirs), (ours, theirs, unguarded)
    if poison == "shouting":
        # first seen at step 2, after 1 step where the rule needs MIN_HISTORY (3): no spike by rewind's
        # definition, so it trains once and is quarantined at its second sighting (docs/config.md)
        assert seen[0] <= MIN_HISTORY and records[0]["step"] == seen[1] == named[0]
    else:  # caught at its first sighting: it never trained, and its step trained the others as without it
        assert records[0]["step"] == seen[0] == named[0]
        from safetensors.torch import load_file

        ours_w, theirs_w = (load_file(str(r.output_dir / "model.safetensors")) for r in (guarded, clean))
        assert all(torch.equal(ours_w[k], theirs_w[k]) for k in theirs_w)  # control: unguarded > ours above
    # measured: quickstart and babble equal (above), shouting 0.3826 vs 0.3851 (unguarded 0.4304, 0.4145,
    # 0.4199: 9-10% over, the control that the 5% line can fail); with the step skipped, not redone, the
    # first two were 0.3878 vs 0.3921 and 0.3662 vs 0.3788
    assert abs(unguarded - theirs) > 0.05 * theirs, (unguarded, theirs)
    assert abs(ours - theirs) <= 0.05 * theirs, (ours, theirs)
    assert all(m.row_tokens[m.rows.index(bad)] == 0 for m in clean.micro if bad in m.rows)


@pytest.mark.slow
def test_skip_vetoes_the_spiking_updates_and_quarantines_nothing(run_training, tmp_path):
    rows, bad = _poisoned("quickstart")
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    result = run_training(_config(data, "skip", epochs=4, learning_rate=5e-3, scheduler="constant"))  # spikes at 32, 44
    skipped = [s.step for s in result.steps if s.metrics.get("update_skipped")]
    guards = read_log(result.output_dir / "rewind.jsonl").guards
    assert skipped and [g["step"] for g in guards] == skipped and {g["action"] for g in guards} == {"skip"}
    assert not (result.output_dir / "quarantine.jsonl").exists()
    assert all(bad in {r for m in result.micro if m.step == s for r in m.rows} for s in skipped)


def test_the_guard_is_refused_where_it_cannot_act(tmp_path):
    from soup_core import load_plugins
    from soup_core.config import ConfigError, validate_config

    plugins = load_plugins()
    data = write_jsonl(tmp_path / "t.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    base = {"base": "x", "task": "sft", "data": {"train": str(data)}, "training": {"spike_guard": "quarantine"}}
    validate_config(base, plugins=plugins)  # control: transformers + sft honour it
    if "mlx" in plugins.backends:
        with pytest.raises(ConfigError, match="training.spike_guard: not honoured .* has no update gate"):
            validate_config({**base, "backend": "mlx"}, plugins=plugins)
    if "unlearn" in plugins.tasks:  # a task that declares no token cross-entropy
        with pytest.raises(ConfigError, match="training.spike_guard: not honoured .* declares no token_cross"):
            validate_config({**base, "task": "unlearn", "data": {"forget": str(data), "retain": str(data)}},
                            plugins=plugins)
    with pytest.raises(ConfigError, match="spike_guard"):
        validate_config({**base, "training": {"spike_guard": "sometimes"}}, plugins=plugins)


def test_a_quarantined_row_of_the_second_file_is_named_by_that_file_and_line(tmp_path):
    from types import SimpleNamespace

    import soup_core
    from soup_plugin_rewind.guard import QUARANTINE_FILE, SpikeGuard

    chat = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]}
            for i in range(4)]
    first = write_jsonl(tmp_path / "a.jsonl", chat)
    second = tmp_path / "b.csv"
    second.write_text("instruction,output\nDouble 1.,2\n\nDouble 2.,4\nDouble 3.,6\n", encoding="utf-8")
    data = {"train": [str(first), {"path": str(second), "weight": 2}]}
    built = soup_core.build_training_list(data, formats=dict(soup_core.load_plugins().data_formats.items()))
    out = tmp_path / "out"
    out.mkdir()
    (out / "soup_config.yaml").write_text(json.dumps({"task": "sft", "data": data}))  # YAML reads JSON
    guard = SpikeGuard()
    guard.start, guard.out = SimpleNamespace(fingerprint=built.fingerprint), out
    guard._quarantine(7, [SimpleNamespace(row=5, share=0.9), SimpleNamespace(row=1, share=0.05)])
    records = [json.loads(line) for line in (out / QUARANTINE_FILE).read_text().splitlines()]
    # row 5 is the second CSV row, on line 4 after a blank line (control: row 1 is the first file's line 2)
    assert [(r["row"], r["file"], r["line"]) for r in records] == [(1, str(first), 2), (5, str(second), 4)]
