"""The cases a new user hit (issue "Trustworthy runs, 2 of 2"), each through the CLI with a control: nothing
trains on nothing, the dry run checks what it can, messages point the right way."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from soup_core.testing import write_jsonl, write_yaml


def long_prompt_rows(n: int, *, short: tuple[int, ...] = ()) -> list[dict[str, str]]:
    """Prompt/completion rows whose prompt alone is longer than 16 tokens, except the rows in ``short``."""
    return [
        {"prompt": "hi" if i in short else "please tell me " * 12 + f"number {i}", "completion": f"it is {i}"}
        for i in range(n)
    ]


def config(tmp_path: Path, model: Path, *, max_length: int, rows: list[dict], **data: object) -> Path:
    write_jsonl(tmp_path / "train.jsonl", rows)
    return write_yaml(tmp_path / "soup.yaml", {
        "base": str(model), "output": str(tmp_path / "out"),
        "data": {"train": "train.jsonl", "max_length": max_length, **data},
        "training": {"max_steps": 2, "batch_size": 2},
    })


def soup(args: list[str], home: Path):
    """``soup ARGS`` through the CLI's own app, in this process (a fresh interpreter per case would cost
    seconds of imports each); ``result.stdout`` and ``result.stderr`` as a user sees them."""
    from soup_core.cli.main import build_app

    return CliRunner().invoke(build_app(), args, prog_name="soup")


# ------------------------------------------------------------------------------ nothing trains on nothing


def test_every_answer_beyond_max_length_fails_instead_of_training_nothing(tiny_model: Path, tmp_path: Path,
                                                                           soup_home: Path) -> None:
    cfg = config(tmp_path, tiny_model, max_length=16, rows=long_prompt_rows(4))
    result = soup(["train", "-c", str(cfg)], soup_home)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert "no training row has a supervised token left at data.max_length=16" in result.stderr
    assert "Traceback" not in result.stderr and "Done." not in result.stdout
    # control: the same rows with room for the answers train, and the run completes
    cfg = config(tmp_path, tiny_model, max_length=128, rows=long_prompt_rows(4))
    result = soup(["train", "-c", str(cfg)], soup_home)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "Done." in result.stdout


@pytest.mark.parametrize("on_bad_row", ["error", "skip"])
def test_dry_run_names_rows_without_supervised_tokens_or_skips_them(tiny_model: Path, tmp_path: Path,
                                                                    soup_home: Path, on_bad_row: str) -> None:
    rows = long_prompt_rows(4, short=(0, 2))
    cfg = config(tmp_path, tiny_model, max_length=16, rows=rows, on_bad_row=on_bad_row)
    result = soup(["train", "-c", str(cfg), "--dry-run"], soup_home)
    if on_bad_row == "error":
        assert result.exit_code == 1, result.stdout + result.stderr
        assert "2 of 4 training rows have no supervised token left at data.max_length=16" in result.stderr
        assert "row 1 (train.jsonl line 2), row 3 (train.jsonl line 4)" in result.stderr
        assert "on_bad_row: skip" in result.stderr
    else:
        assert result.exit_code == 0, result.stdout + result.stderr
        assert "2 rows skipped (no supervised token left)" in result.stdout
    # control: every prompt short, nothing to say
    cfg = config(tmp_path, tiny_model, max_length=16, rows=long_prompt_rows(4, short=(0, 1, 2, 3)),
                 on_bad_row=on_bad_row)
    result = soup(["train", "-c", str(cfg), "--dry-run"], soup_home)
    assert result.exit_code == 0 and "skipped" not in result.stdout, result.stdout + result.stderr


def test_dry_run_refuses_zero_supervised_tokens(tiny_model: Path, tmp_path: Path, soup_home: Path) -> None:
    cfg = config(tmp_path, tiny_model, max_length=16, rows=long_prompt_rows(4), on_bad_row="skip")
    result = soup(["train", "-c", str(cfg), "--dry-run"], soup_home)
    assert result.exit_code == 1 and "no training row has a supervised token" in result.stderr
