"""`soup eval --tasks` through lm-evaluation-harness: a local YAML task over a local JSONL, offline, gives the
metrics `simple_evaluate` gives when handed the same trained model directly (and not the base's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eval_kit import Runs, invoke

from soup_plugin_eval.eval_cmd import eval_

pytest.importorskip("lm_eval", reason='soup-plugin-eval[harness] is not installed')


@pytest.fixture
def task_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = tmp_path / "sums.jsonl"
    docs.write_text("".join(json.dumps({"question": f"what is {i} plus {i}?", "answer": f"{i} plus {i} is {2 * i}."})
                            + "\n" for i in range(30, 36)), encoding="utf-8")
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "soup_sums.yaml").write_text(f"""task: soup_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{question}}}}"
doc_to_target: " {{{{answer}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
""", encoding="utf-8")
    return folder


def direct(model_dir: Path, tokenizer_dir: Path, adapter: Path | None, folder: Path) -> dict:
    """lm-eval by hand: the model loaded with transformers (and peft), handed to simple_evaluate."""
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    lm = HFLM(pretrained=model.eval(), tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir), batch_size=4)
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    out = simple_evaluate(model=lm, tasks=["soup_sums"], task_manager=manager, log_samples=False)
    return out["results"]["soup_sums"]


def test_local_task_equals_simple_evaluate(in_home: Runs, task_dir: Path, tmp_path: Path, tiny_model: Path) -> None:
    out = in_home.lora.output_dir
    expected = direct(tiny_model, out, out, task_dir)
    assert expected["perplexity,none"] != direct(tiny_model, out, None, task_dir)["perplexity,none"]  # not the base
    report = tmp_path / "tasks.json"
    result = invoke(eval_, [str(out), "--tasks", "soup_sums", "--include-path", str(task_dir), "--batch-size", "4",
                            "--json", str(report)])
    assert result.exit_code == 0, result.output
    got = json.loads(report.read_text(encoding="utf-8"))["targets"][0]["results"]["soup_sums"]
    assert got["perplexity"] == expected["perplexity,none"]
    assert got["acc"] == expected["acc,none"]


def test_base_beside_trained(in_home: Runs, task_dir: Path, tmp_path: Path, tiny_model: Path) -> None:
    """--base: the first column is the base (the adapter turned off), equal to lm-eval on the base loaded by hand;
    the trained model's column is the adapter's own (the two differ: the control)."""
    out = in_home.lora.output_dir
    report = tmp_path / "tasks.json"
    result = invoke(eval_, [str(out), "--tasks", "soup_sums", "--include-path", str(task_dir), "--batch-size", "4",
                            "--base", "--json", str(report)])
    assert result.exit_code == 0, result.output
    base, trained = json.loads(report.read_text(encoding="utf-8"))["targets"]
    assert (base["label"], base["run_id"]) == ("base", None)
    assert base["results"]["soup_sums"]["perplexity"] == direct(tiny_model, out, None, task_dir)["perplexity,none"]
    assert trained["results"]["soup_sums"]["perplexity"] == direct(tiny_model, out, out, task_dir)["perplexity,none"]
    assert base["results"]["soup_sums"]["perplexity"] != trained["results"]["soup_sums"]["perplexity"]
    header = next(line for line in result.output.splitlines() if "metric" in line)
    assert header.index("base") < header.index(trained["label"][:10])  # side by side, the base first
