"""``soup unlearn eval`` loads the base the way the run did: a 4-bit run is evaluated on the 4-bit base (its
starting numbers equal the run's own), and a run whose loading cannot be repeated is refused with the reason.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = pytest.mark.slow


def _eval(run_id: str, tmp_path) -> tuple[Any, dict[str, Any] | None]:
    from typer.testing import CliRunner

    from soup_core.testing import registered_plugin
    from soup_plugin_unlearn import plugin
    from soup_plugin_unlearn.cli import app

    out = tmp_path / f"eval-{run_id}.json"
    with registered_plugin("unlearn", plugin):
        result = CliRunner().invoke(app, ["eval", "--run", run_id, "--json", str(out)])
    return result, (json.loads(out.read_text()) if out.exists() else None)


def _fp32_forget_loss(base, record: dict[str, Any]) -> float:
    """The forget loss of the float32 base, by plain transformers (what eval measured before)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.sft import encode_rows
    from soup_plugin_unlearn.demo import data_file

    tok = AutoTokenizer.from_pretrained(base)
    rows = [json.loads(line) for line in data_file("forget.jsonl").read_text().splitlines()]
    examples = encode_rows(rows, tok, max_length=48)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for e in examples:
            out = model(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]]))
            n = sum(1 for label in e["labels"][1:] if label != -100)
            total, tokens = total + float(out.loss) * n, tokens + n
    return total / tokens


def test_eval_of_a_4bit_run_loads_the_4bit_base(unlearn_config, soup_train, tiny_model, tmp_path):
    pytest.importorskip("bitsandbytes")
    run = soup_train(unlearn_config("q4", training={"quantization": "4bit", "max_steps": 1}))
    own = json.loads((run.output_dir / "unlearn_eval.json").read_text())
    result, numbers = _eval(run.run_id, tmp_path)
    assert result.exit_code == 0, result.output
    # the starting model eval measures is the one the run measured: the 4-bit base
    assert numbers["start"]["forget_loss"] == pytest.approx(own["start"]["forget_loss"], rel=1e-5)
    assert numbers["start"]["retain_loss"] == pytest.approx(own["start"]["retain_loss"], rel=1e-5)
    assert numbers["end"]["forget_loss"] == pytest.approx(own["end"]["forget_loss"], rel=1e-5)
    # control: the float32 base (what eval loaded before) gives another starting number, so the
    # comparison above can fail
    fp32 = _fp32_forget_loss(tiny_model, own)
    assert fp32 != pytest.approx(own["start"]["forget_loss"], rel=1e-4), (fp32, own["start"])


def test_eval_says_why_it_cannot_load_the_base_as_the_run_did(
    unlearn_config, soup_train, tmp_path, monkeypatch
):
    run = soup_train(unlearn_config("q4-gone", training={"max_steps": 1}))
    # the run's saved config now asks for 8-bit loading, and this machine's loader refuses it
    from soup_core import Tracker

    tracker = Tracker()
    record = tracker.get_run(run.run_id)
    saved = dict(record.config)
    saved["training"] = {**saved["training"], "quantization": "8bit"}
    import soup_core.default_plugins.transformers.loading as loading

    def refuse(config: Any) -> Any:
        assert config.training.quantization == "8bit"  # the saved setting reached the loader
        raise loading.BackendError("bitsandbytes cannot load 8-bit weights on this machine")

    monkeypatch.setattr(loading, "load_model_and_tokenizer", refuse)
    monkeypatch.setattr(type(tracker), "get_run", lambda self, ref: type(record)(**{**record.__dict__,
                                                                                    "config": saved}))
    result, numbers = _eval(run.run_id, tmp_path)
    assert result.exit_code == 1 and numbers is None
    text = " ".join(result.output.split())
    assert "training.quantization 8bit" in text and "cannot be loaded that way here" in text, text
    assert "bitsandbytes cannot load 8-bit weights" in text and "Traceback" not in text
