"""soup train keeps its console output in OUTPUT/soup-output.log: what was printed before the folder was the
run's, then every line as it is printed, one header per run."""

from __future__ import annotations

import sys
from pathlib import Path

from soup_core.default_plugins.commands.console_log import LOG_NAME, kept_output, run_part


def test_the_log_holds_what_was_printed_before_and_after_the_claim(tmp_path: Path, capsys) -> None:
    with kept_output() as kept:
        print("planned")
        print("a warning", file=sys.stderr)
        kept.attach(tmp_path, "run_a")
        print("step 1/2")
        text = (tmp_path / LOG_NAME).read_text()  # flushed as printed: a killed run keeps it
        assert text.endswith("planned\na warning\nstep 1/2\n") and text.startswith("=== soup run run_a ")
    print("after the block")
    assert "after the block" not in (tmp_path / LOG_NAME).read_text()
    assert capsys.readouterr().out == "planned\nstep 1/2\nafter the block\n"  # the terminal still sees it all


def test_a_resumed_run_appends_its_own_part(tmp_path: Path) -> None:
    for run, line in (("run_a", "first"), ("run_b", "second")):
        with kept_output() as kept:
            kept.attach(tmp_path, run)
            print(line)
    text = (tmp_path / LOG_NAME).read_text()
    assert run_part(text, "run_a").splitlines()[1:] == ["first"]
    assert run_part(text, "run_b").splitlines()[1:] == ["second"]
    assert run_part(text, "run_c") == text  # control: an unnamed run gets the whole log


def test_nothing_is_written_without_a_claim(tmp_path: Path) -> None:
    with kept_output():
        print("refused before any run")
    assert list(tmp_path.iterdir()) == []
