"""End to end on the bundled demo, as the docs run it, and the acceptance of each method at its documented
defaults: the core's sft teaches a tiny model (4 layers, hidden 128, full fine-tuning) every fact; then each
method, naming nothing but itself (β, γ, α, rmu's layer, coefficient, trained parameters and token
averaging at their defaults), makes it forget the forget set and keep the retain set. rmu's default c is
scaled to this model (5 × the steered layer's mean activation norm, about 58 here) and α is 100: the README
lists the settings measured not to reach the bar (the paper's Zephyr-7B c = 6.5, α = 1200 among them).

Acceptance, measured here independently of the plugin's code (plain transformers: its own loss, greedy
generation): greedy exact-match recall of the forget set at most 10%, of the retain set at least 90%.
``soup unlearn eval`` then prints the same numbers, for an adapter run and for rmu's whole-model run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

METHODS = ("npo", "simnpo", "rmu")


def _encoded(tok: Any, path: Path) -> list[dict[str, Any]]:
    from soup_core.default_plugins.sft import encode_rows

    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return encode_rows(rows, tok, max_length=64)


def _loss(model: Any, examples: list[dict[str, Any]], pad: int) -> float:
    """transformers' own loss over the whole set in one padded batch: the mean over every answer token."""
    import torch

    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.tensor([e["input_ids"] + [pad] * (width - len(e["input_ids"])) for e in examples])
    labels = torch.tensor([e["labels"] + [-100] * (width - len(e["labels"])) for e in examples])
    mask = torch.tensor([[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in examples])
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)


def _recall(model: Any, examples: list[dict[str, Any]], pad: int) -> float:
    """Greedy exact match: the generated continuation of the prompt equals the answer and its end token."""
    import torch

    hits = 0
    model.eval()
    for e in examples:
        prompt = [t for t, label in zip(e["input_ids"], e["labels"], strict=True) if label == -100]
        answer = [t for t, label in zip(e["input_ids"], e["labels"], strict=True) if label != -100]
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=len(answer),
                do_sample=False,
                pad_token_id=pad,
            )
        hits += out[0, len(prompt) :].tolist() == answer
    return hits / len(examples)


def _load(path: Path, adapter: Path | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapter is None:
        return model
    if not (adapter / "adapter_config.json").exists():  # a whole model (rmu's published recipe)
        return AutoModelForCausalLM.from_pretrained(adapter, dtype=torch.float32)
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter))


@pytest.fixture(scope="session")
def demo(tmp_path_factory, session_home, torch_one_thread) -> Path:
    from soup_plugin_unlearn.demo import write_demo

    folder = tmp_path_factory.mktemp("unlearn-demo")
    write_demo(folder)
    return folder


@pytest.fixture(scope="session")
def facts(demo) -> dict[str, Any]:
    """The SFT phase through the core's sft task, and the measurements before and after it."""
    import yaml
    from transformers import AutoTokenizer

    learn = yaml.safe_load((demo / "learn.yaml").read_text())
    tok = AutoTokenizer.from_pretrained(learn["base"])
    forget, retain = _encoded(tok, demo / "forget.jsonl"), _encoded(tok, demo / "retain.jsonl")
    pad = tok.pad_token_id
    untrained = _load(Path(learn["base"]))
    return {
        "tok": tok,
        "forget": forget,
        "retain": retain,
        "pad": pad,
        "untrained_forget_loss": _loss(untrained, forget, pad),
        "learn": learn,
    }


@pytest.fixture(scope="session")
def learned(demo, facts, soup_train_session) -> dict[str, Any]:
    run = soup_train_session(demo / "learn.yaml")
    model = _load(run.output_dir)
    pad = facts["pad"]
    return {
        "path": run.output_dir,
        "forget_loss": _loss(model, facts["forget"], pad),
        "forget_recall": _recall(model, facts["forget"], pad),
        "retain_recall": _recall(model, facts["retain"], pad),
    }


@pytest.fixture(scope="session")
def unlearned(demo, learned, soup_train_session) -> dict[str, Any]:
    runs = {}
    for method in METHODS:
        runs[method] = soup_train_session(demo / f"unlearn-{method}.yaml")
    return runs


def test_the_sft_phase_memorised_every_fact(facts, learned):
    assert facts["untrained_forget_loss"] > 5.0  # about ln(vocabulary): the untrained model knows nothing
    assert learned["forget_loss"] < 0.1
    assert learned["forget_recall"] == 1.0 and learned["retain_recall"] == 1.0


@pytest.mark.parametrize("method", METHODS)
def test_each_method_at_its_defaults_forgets_the_forget_set_and_keeps_the_retain_set(
    method, facts, learned, unlearned
):
    model = _load(learned["path"], unlearned[method].output_dir)
    forget_recall = _recall(model, facts["forget"], facts["pad"])
    retain_recall = _recall(model, facts["retain"], facts["pad"])
    assert forget_recall <= 0.10 and retain_recall >= 0.90, (method, forget_recall, retain_recall)


@pytest.mark.parametrize("method", METHODS)
def test_the_watchdog_leaves_every_demo_run_alone(method, unlearned):
    """A negative control for the watchdog (on by default): the forget loss rises by design, so unlearn gets
    only the non-finite rule, and no update of the demo is skipped or stopped."""
    run = unlearned[method]
    assert run.status == "completed" and run.steps
    assert not [s.step for s in run.steps if "update_skipped" in s.metrics]


@pytest.mark.parametrize("method", METHODS)
def test_each_runs_own_evaluation_matches_plain_transformers(method, facts, learned, unlearned):
    run = unlearned[method]
    model = _load(learned["path"], run.output_dir)
    forget_loss = _loss(model, facts["forget"], facts["pad"])
    record = json.loads((run.output_dir / "unlearn_eval.json").read_text(encoding="utf-8"))
    assert record["params"]["method"] == method
    assert record["start"]["forget_loss"] == pytest.approx(learned["forget_loss"], rel=1e-4)
    assert record["end"]["forget_loss"] == pytest.approx(forget_loss, rel=1e-4)


@pytest.mark.parametrize("method", ["npo", "rmu"])  # an adapter run, and rmu's whole-model run
def test_unlearn_eval_prints_the_table(method, facts, learned, unlearned, tmp_path):
    from typer.testing import CliRunner

    from soup_core.testing import registered_plugin
    from soup_plugin_unlearn import plugin
    from soup_plugin_unlearn.cli import app

    run_id = json.loads((unlearned[method].output_dir / "unlearn_eval.json").read_text())["run_id"]
    out = tmp_path / "eval.json"
    with registered_plugin("unlearn", plugin):
        result = CliRunner().invoke(app, ["eval", "--run", run_id, "--recall", "--json", str(out)])
    assert result.exit_code == 0, result.output
    numbers = json.loads(out.read_text())
    model = _load(learned["path"], unlearned[method].output_dir)
    forget_loss = _loss(model, facts["forget"], facts["pad"])
    assert numbers["end"]["forget_loss"] == pytest.approx(forget_loss, rel=1e-4)
    assert numbers["start"]["forget_loss"] == pytest.approx(learned["forget_loss"], rel=1e-4)
    assert numbers["end"]["retain_recall"] == pytest.approx(_recall(model, facts["retain"], facts["pad"]))
    assert numbers["start"]["forget_recall"] == 1.0 and numbers["rows"] == {"forget": 8, "retain": 16}
    text = result.output
    assert f"{numbers['start']['forget_loss']:.4f}" in text and f"{numbers['end']['forget_loss']:.4f}" in text
    assert "forget" in text and "retain" in text and "100%" in text


def test_unlearn_eval_refuses_what_it_cannot_evaluate(learned, unlearned):
    from typer.testing import CliRunner

    from soup_core import Tracker
    from soup_plugin_unlearn.cli import app

    missing = CliRunner().invoke(app, ["eval", "--run", "run_nope"])
    assert missing.exit_code == 1 and "no run 'run_nope' in the tracker" in missing.output
    sft = next(r for r in Tracker().list_runs(None) if r.task == "sft")
    wrong = CliRunner().invoke(app, ["eval", "--run", sft.run_id])
    assert wrong.exit_code == 1 and f"run {sft.run_id} is a 'sft' run, not an unlearn run" in wrong.output


def test_the_demo_command_writes_data_the_loader_accepts(tmp_path):
    from typer.testing import CliRunner

    import soup_core
    from soup_plugin_unlearn.cli import app
    from soup_plugin_unlearn.task import UnlearnTask

    result = CliRunner().invoke(app, ["demo", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "d"
    assert {p.name for p in folder.iterdir()} == {
        "forget.jsonl",
        "retain.jsonl",
        "facts.jsonl",
        "learn.yaml",
        "unlearn-npo.yaml",
        "unlearn-simnpo.yaml",
        "unlearn-rmu.yaml",
    }
    formats = dict(soup_core.load_plugins().data_formats.items())
    for key, n in (("forget", 8), ("retain", 16)):
        rows = soup_core.build_training_list(
            {key: str(folder / f"{key}.jsonl")}, key=key, formats=formats, accepted=UnlearnTask.formats
        )
        assert (rows.n_rows, rows.format, rows.skipped) == (n, "prompt_completion", [])
    facts = (folder / "facts.jsonl").read_text()
    assert facts == (folder / "forget.jsonl").read_text() + (folder / "retain.jsonl").read_text()
