"""`soup eval`: the per-row losses of a checkpoint saved after step k, on the rows of step k+1, are the per-row
losses the rewind log recorded for step k+1 (training's own forward pass at those weights, dropout 0); the
data's loss is the token-weighted mean of them and the perplexity exp of it; results are stored with the run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from eval_kit import Runs, invoke, sums

from soup_plugin_eval.eval_cmd import eval_


def logged(runs: Runs, step: int) -> dict[int, float]:
    """Row index -> loss, as the rewind log recorded it for ``step``."""
    out: dict[int, float] = {}
    for line in (runs.lora.output_dir / "rewind.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("kind") == "batch" and record["step"] == step:
            out.update(zip(record["rows"], record["row_loss"], strict=True))
    return out


def scored(target: Path | str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "scores.json"
    result = invoke(eval_, [str(target), *args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text(encoding="utf-8"))


def test_checkpoint_losses_equal_the_rewind_log(in_home: Runs, tmp_path: Path) -> None:
    out = in_home.lora.output_dir
    step2 = logged(in_home, 2)
    assert len(step2) == 4
    rows = {r["index"]: r for r in scored(out / "checkpoint-1", tmp_path, "--data", str(in_home.data))
            ["targets"][0]["row_losses"]}
    for index, loss in step2.items():
        assert rows[index]["loss"] == pytest.approx(loss, abs=1e-5)
    # control: the weights after step 2 give other losses on those rows
    later = {r["index"]: r["loss"] for r in scored(out / "checkpoint-2", tmp_path, "--data", str(in_home.data))
             ["targets"][0]["row_losses"]}
    assert max(abs(later[i] - loss) for i, loss in step2.items()) > 1e-3


def test_loss_is_the_token_mean_and_perplexity_its_exp(in_home: Runs, tmp_path: Path) -> None:
    target = scored(in_home.lora.output_dir, tmp_path, "--data", str(in_home.data))["targets"][0]
    rows = target["row_losses"]
    assert len(rows) == target["rows"] == 16 and sum(r["tokens"] for r in rows) == target["tokens"]
    mean = sum(r["loss"] * r["tokens"] for r in rows) / target["tokens"]
    assert target["loss"] == pytest.approx(mean, rel=1e-12)
    assert target["perplexity"] == pytest.approx(math.exp(mean), rel=1e-12)


def test_several_targets_side_by_side_and_stored_with_the_run(in_home: Runs, tmp_path: Path) -> None:
    from soup_core.testing import run_soup

    out = in_home.lora.output_dir
    result = invoke(eval_, [str(out / "checkpoint-1"), str(out), "--data", str(in_home.data)])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if "output/checkpoint-1 " in line or "│ output " in line]
    assert len(rows) == 2, result.stdout
    shown = run_soup(["runs", "show", in_home.lora.run_id, "--json"])
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)["summary"]
    assert summary["eval train.jsonl @ checkpoint-1"].startswith("loss ")
    assert summary["eval train.jsonl @ output"].startswith("loss ")
    shown = run_soup(["runs", "show", in_home.lora.run_id], env={"COLUMNS": "200"})
    assert "summary.eval train.jsonl @ checkpoint-1" in shown.stdout, shown.stdout


def test_val_scores_the_runs_validation_split(in_home: Runs, tmp_path: Path, tiny_model: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from soup_core import build_training_list, load_plugins
    from soup_core.testing import train_in_process, write_jsonl

    monkeypatch.setenv("SOUP_HOME", str(tmp_path / "home"))  # its own tracker: `latest` stays the session's
    data = write_jsonl(tmp_path / "rows.jsonl", sums(12))
    run = train_in_process({"data": {"train": str(data), "max_length": 64, "val_split": 0.25},
                            "training": {"max_steps": 1, "batch_size": 4}}, workdir=tmp_path, default_base=tiny_model)
    built = build_training_list({"train": str(data), "val_split": 0.25, "seed": 42},
                                formats=load_plugins().data_formats)
    val_rows = built.val_rows
    assert len(val_rows) == 3
    held_out = write_jsonl(tmp_path / "held_out.jsonl", val_rows)
    by_val = scored(run.output_dir, tmp_path, "--val")["targets"][0]
    by_file = scored(run.output_dir, tmp_path, "--data", str(held_out))["targets"][0]

    def scores(rows: list) -> list:
        return [(r["index"], r["loss"], r["tokens"]) for r in rows]

    assert by_val["rows"] == 3 and scores(by_val["row_losses"]) == scores(by_file["row_losses"])
    # each row names where it came from: its line in the run's data for the split, in --data for a file
    assert [(r["file"], r["line"]) for r in by_val["row_losses"]] == built.val_origins
    assert [(r["file"], r["line"]) for r in by_file["row_losses"]] == [(str(held_out), n) for n in (1, 2, 3)]
    assert built.val_origins != [(str(data), n) for n in (1, 2, 3)]  # control: the split's own lines, not positions
    assert by_val["loss"] != scored(run.output_dir, tmp_path, "--data", str(data))["targets"][0]["loss"]  # control
    write_jsonl(data, sums(12, start=1))  # the run's data changed: its split cannot be rebuilt
    result = invoke(eval_, [str(run.output_dir), "--val"])
    assert result.exit_code == 1 and "changed since it trained" in result.output, result.output


@pytest.mark.parametrize(("args", "code", "message"), [
    ([], 2, "give one of --data FILE, --val, --facts FILE or --tasks"),
    (["--facts", "x.jsonl", "--val"], 2, "give one of"),
    (["--val", "--data", "x.jsonl"], 2, "give one of"),
    (["--val"], 1, "held out no validation rows"),
    (["--data", "missing.jsonl"], 1, "no such file"),
    (["--data", "x.jsonl", "--limit", "3"], 2, "go with --tasks"),
    (["--data", "x.jsonl", "--base"], 2, "go with --tasks"),
])
def test_usage_errors(in_home: Runs, args: list[str], code: int, message: str) -> None:
    result = invoke(eval_, [str(in_home.lora.output_dir), *args])
    assert result.exit_code == code and message in result.output, result.output
    assert "Traceback" not in result.output


def test_a_task_without_a_token_encoding_is_refused() -> None:
    """An rl task tokenises in trl's trainer, not through encode: there is no training encoding to score with."""
    from types import SimpleNamespace

    from soup_plugin_eval.evaluate import encode
    from soup_plugin_eval.target import TargetError

    class NoEncode:
        pass

    class Encodes:
        def encode(self, rows, tokenizer, config):
            return [{"input_ids": [1, 2], "labels": [-100, 2], "row_index": i} for i, _ in enumerate(rows)]

    target = SimpleNamespace(config=SimpleNamespace(task="t"))
    with pytest.raises(TargetError, match="no training encoding"):
        encode(target, SimpleNamespace(tasks={"t": NoEncode}), [{"text": "a"}], None)
    assert len(encode(target, SimpleNamespace(tasks={"t": Encodes}), [{"text": "a"}], None)) == 1  # the control


def test_data_is_read_in_the_format_of_the_runs_own_entry_for_it(tmp_path: Path) -> None:
    from soup_core import load_plugins
    from soup_core.config import validate_config
    from soup_plugin_eval.evaluate import data_format

    for name in ("a.jsonl", "b.csv", "c.jsonl"):
        (tmp_path / name).write_text("")
    a, b, c = (tmp_path / n for n in ("a.jsonl", "b.csv", "c.jsonl"))

    def config(train: object, fmt: str = "chat") -> object:
        return validate_config({"base": "x", "data": {"train": train, "format": fmt}}, plugins=load_plugins())

    mixed = config([str(a), {"path": str(b), "format": "alpaca", "weight": 2}])
    assert data_format(mixed, b) == "alpaca"  # the run read b.csv as alpaca, not as its data.format
    assert data_format(mixed, a) == "chat"
    assert data_format(mixed, c) == "auto"  # another file, and the run's files had two formats
    assert data_format(config(str(a)), c) == "chat"  # control: one format for the whole run is kept


def test_facts_counts_the_greedy_answers_that_state_their_fact(in_home: Runs, tmp_path: Path) -> None:
    """--facts answers each prompt greedily with the run's chat template, as the quickstart does
    (facts.greedy_answers on the same model gives the same answers), and a question counts when its fact is in
    the answer, case-insensitive: a fact cut from the answer (upper-cased) counts, one not in it does not."""
    from soup_core.default_plugins import transformers as key_facts
    from soup_plugin_eval.model import load
    from soup_plugin_eval.target import resolve

    questions = tmp_path / "q.jsonl"
    prompts = ["what is 3 plus 3?", "what is 21 plus 21?"]
    questions.write_text("".join(json.dumps({"prompt": p, "fact": "zz-not-said"}) + "\n" for p in prompts))
    first = scored(in_home.lora.output_dir, tmp_path, "--facts", str(questions))["targets"][0]
    answers = [r["answer"] for r in first["results"]]
    assert first["questions"] == 2 and first["stated"] == 0 and all(answers), answers
    from soup_core import load_plugins

    loaded = load(resolve(str(in_home.lora.output_dir), plugins=load_plugins()))
    assert key_facts.greedy_answers(loaded.model, loaded.tokenizer, prompts) == answers
    said = answers[0].split()[0].upper()  # a word of the first answer, in other case
    questions.write_text(json.dumps({"prompt": prompts[0], "fact": said}) + "\n"
                         + json.dumps({"prompt": prompts[1], "fact": "zz-not-said"}) + "\n")
    second = scored(in_home.lora.output_dir, tmp_path, "--facts", str(questions))["targets"][0]
    assert [r["hit"] for r in second["results"]] == [True, False] and second["stated"] == 1
    assert [r["answer"] for r in second["results"]] == answers  # the same greedy answers
    questions.write_text('{"prompt": "q"}\n')
    bad = invoke(eval_, [str(in_home.lora.output_dir), "--facts", str(questions)])
    assert bad.exit_code == 1 and f"{questions}:1:" in bad.output and "Traceback" not in bad.output
