"""`soup init` writes configs that validate as written, and sample data that passes a dry run."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from soup_core.config import load_config
from soup_core.default_plugins.commands.init_cmd import TEMPLATES, init

runner = CliRunner()


def _app():
    import typer

    app = typer.Typer()
    app.command()(init)
    return app


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_template_validates_as_written_and_its_data_builds(template: str, tmp_path: Path, monkeypatch) -> None:
    from soup_core.plugins import load_plugins
    from soup_core.run import plan_run

    monkeypatch.chdir(tmp_path)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # offline, an uncached hub base is refused at plan
        monkeypatch.delenv(name, raising=False)
    result = runner.invoke(_app(), ["--template", template])
    assert result.exit_code == 0, result.output
    config = load_config(tmp_path / "soup.yaml")
    assert config.data.format == TEMPLATES[template]["format"]
    plan = plan_run(config, plugins=load_plugins(), base_dir=tmp_path)
    assert plan.data["train"].n_rows == 8


def test_existing_config_is_kept_unless_forced(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "soup.yaml").write_text("mine\n")
    result = runner.invoke(_app(), [])
    assert result.exit_code == 1 and "--force" in result.output
    assert (tmp_path / "soup.yaml").read_text() == "mine\n"
    assert runner.invoke(_app(), ["--force", "--no-data"]).exit_code == 0
    assert not (tmp_path / "data").exists()


def test_unknown_template_is_a_usage_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(_app(), ["--template", "nope"])
    assert result.exit_code == 2 and "chat" in result.output
