"""``data.chat_template``: checked at config time, applied to the run's tokenizer (and the one it saves), and
end to end: a base without a template trains chat rows, and ``soup rewind`` names the poisoned row."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from soup_core.config import ConfigError, load_config_text
from soup_core.default_plugins.chat_templates import TEMPLATES, resolve

pytest_plugins = ["soup_core.testing"]


def _config_text(template: str) -> str:
    return "base: some/model\ndata:\n  train: rows.jsonl\n  chat_template: " + json.dumps(template) + "\n"


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_every_shipped_name_and_its_text_validate(name: str) -> None:
    assert load_config_text(_config_text(name)).data.chat_template == name
    assert load_config_text(_config_text(TEMPLATES[name])).data.chat_template == TEMPLATES[name]
    assert load_config_text("base: m\ndata:\n  train: r.jsonl\n").data.chat_template is None


@pytest.mark.parametrize(("template", "says"), [
    ("chatml2", "'chatml2' is not a chat template Soup ships (chatml, llama3, zephyr, simple)"),
    ("{% for m in messages %}{{ m['content'] }}", "does not parse: Unexpected end of template"),
    ("{{ messages[0]['content'] }}", "leaves out the assistant's message"),
    ("{{ raise_exception('no system role') }}", "fails to render a conversation: TemplateError: no system role"),
])
def test_a_bad_template_is_refused_at_config_time(template: str, says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config_text(_config_text(template))
    assert [issue.path for issue in refused.value.issues] == ["data.chat_template"]
    assert says in str(refused.value)


def test_a_syntax_error_names_its_line() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config_text(_config_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"))
    assert "(line 2 of the template)" in str(refused.value)


def test_the_shipped_templates_train_only_the_answer(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello there"}]
    for name in TEMPLATES:
        tokenizer.chat_template = resolve(name)
        enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        trained = tokenizer.decode([t for t, keep in zip(enc["input_ids"], enc["assistant_masks"], strict=True)
                                     if keep])
        assert trained.startswith("Hello there") and "Hi" not in trained, (name, trained)


# ------------------------------------------------------------------------------------------ end to end

POISONED = 17
N_ROWS = 32


def _base_without_template(tiny_model: Path, folder: Path) -> Path:
    base = folder / "base-no-template"
    shutil.copytree(tiny_model, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    return base


def _write_rows(path: Path) -> int:
    """Chat rows with one poisoned answer; two comment-free blank lines first, so row != line - 1. Returns
    the poisoned row's line."""
    rng = random.Random(0)
    rows = []
    for _ in range(N_ROWS):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]})
    garbage = "".join(rng.choice("qzxjkvwy#@!%&*") for _ in range(600))
    rows[POISONED] = {"messages": [{"role": "user", "content": "What is 1 plus 1?"},
                                   {"role": "assistant", "content": "GARBAGE " + garbage}]}
    path.write_text("\n\n" + "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return 2 + POISONED + 1


def test_a_base_without_a_template_trains_chat_rows_with_a_chosen_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, torch_one_thread, tiny_model: Path, soup_home: Path
) -> None:
    from transformers import AutoTokenizer

    import soup_plugin_rewind.plugin as rewind_plugin
    from soup_core import build_training_list, load_plugins
    from soup_core.cli.main import main
    from soup_core.testing import registered_plugin

    base = _base_without_template(tiny_model, tmp_path)
    assert not AutoTokenizer.from_pretrained(base).chat_template
    monkeypatch.chdir(tmp_path)
    line = _write_rows(tmp_path / "data.jsonl")
    config = (f"base: {base}\noutput: ./output\ndata:\n  train: data.jsonl\n  max_length: 256\n"
              "training:\n  epochs: 4\n  batch_size: 4\n  learning_rate: 0.01\n  lora:\n    r: 0\n")
    # control: without data.chat_template the chat rows cannot be rendered, and the message says what to set
    (tmp_path / "plain.yaml").write_text(config.replace("./output", "./plain"), encoding="utf-8")
    with pytest.raises(SystemExit) as refused:
        main(["train", "-c", "plain.yaml", "--dry-run"])
    assert refused.value.code == 1
    assert "data.chat_template" in capsys.readouterr().err

    (tmp_path / "soup.yaml").write_text(config.replace("max_length: 256\n", "max_length: 256\n  chat_template: "
                                                        "chatml\n"), encoding="utf-8")
    with registered_plugin("rewind", rewind_plugin):
        with pytest.raises(SystemExit) as trained:
            main(["train"])
        assert trained.value.code in (0, None), capsys.readouterr()
        capsys.readouterr()
        with pytest.raises(SystemExit) as reported:
            main(["rewind", "--json", "report.json"])
    assert reported.value.code in (0, None)
    # the run recorded the template: in its resolved config, and in the tokenizer saved beside the model
    saved = AutoTokenizer.from_pretrained(tmp_path / "output")
    assert saved.chat_template == TEMPLATES["chatml"]
    assert "chat_template: chatml" in (tmp_path / "output" / "soup_config.yaml").read_text()
    # rewind names the poisoned row, and that row is the poisoned line of data.jsonl
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["spikes"] and doc["rows"][0]["row"] == POISONED and doc["rows"][0]["share"] >= 0.5
    assert doc["rows"][0]["preview"].startswith("user: What is 1 plus 1?\nassistant: GARBAGE")
    from soup_core.config import load_config

    run_config = load_config(tmp_path / "output" / "soup_config.yaml")
    training = build_training_list(run_config.data, formats=dict(load_plugins().data_formats.items()),
                                   base_dir=tmp_path)
    assert training.origins[POISONED] == ("data.jsonl", line)
    assert training.origins[POISONED - 1] == ("data.jsonl", line - 1)


def test_merge_carries_the_runs_template(tmp_path: Path, monkeypatch, capsys, torch_one_thread, tiny_model: Path,
                                          soup_home: Path) -> None:
    from transformers import AutoTokenizer

    from soup_core.cli.main import main

    base = _base_without_template(tiny_model, tmp_path)
    monkeypatch.chdir(tmp_path)
    _write_rows(tmp_path / "data.jsonl")
    (tmp_path / "soup.yaml").write_text(
        f"base: {base}\noutput: ./adapter\ndata:\n  train: data.jsonl\n  chat_template: zephyr\n"
        "training:\n  max_steps: 2\n  batch_size: 2\n", encoding="utf-8")
    with pytest.raises(SystemExit) as trained:
        main(["train"])
    assert trained.value.code in (0, None), capsys.readouterr()
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    with pytest.raises(SystemExit) as merged:
        main(["merge", "adapter", "-o", "merged"])
    assert merged.value.code in (0, None), capsys.readouterr()
    for folder in ("adapter", "merged"):
        assert AutoTokenizer.from_pretrained(tmp_path / folder).chat_template == TEMPLATES["zephyr"], folder
    assert not AutoTokenizer.from_pretrained(base).chat_template  # control: the base still has none
