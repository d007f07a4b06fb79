"""``--to ollama``: each chat template Soup ships, translated into Ollama's template language, renders a
conversation exactly as the Jinja template renders it with ``add_generation_prompt`` (what the model was trained
to continue); a run trained with chatml exports a folder Ollama's ``ollama create`` takes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from soup_core.default_plugins.chat_templates import TEMPLATES, render
from soup_plugin_gguf.ollama import go_template

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And 2 plus 2?"}]


def _go(template: str, messages: list[dict[str, str]]) -> str:
    """Render the subset of Go's text/template the translations use: ``range .Messages``, ``.Role``,
    ``.Content`` and ``if eq .Role "x"`` / ``else if`` / ``else`` / ``end``."""
    parts = re.split(r"({{.*?}})", template)
    start, end = parts.index("{{ range .Messages }}"), len(parts) - 1 - parts[::-1].index("{{ end }}")
    body, out = parts[start + 1:end], "".join(parts[:start])
    for message in messages:
        taking, done = [True], [False]
        for part in body:
            if (m := re.fullmatch(r'{{ (else )?if eq \.Role "(\w+)" }}', part)):
                if m.group(1):
                    done[-1] = done[-1] or taking[-1]
                    taking[-1] = not done[-1] and message["role"] == m.group(2)
                else:
                    taking.append(message["role"] == m.group(2))
                    done.append(False)
            elif part == "{{ else }}":
                done[-1] = done[-1] or taking[-1]
                taking[-1] = not done[-1]
            elif part == "{{ end }}":
                taking.pop(), done.pop()
            elif all(taking):
                out += {"{{ .Role }}": message["role"], "{{ .Content }}": message["content"]}.get(part, part)
    return out + "".join(parts[end + 1:])


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_shipped_template_renders_as_its_jinja(name: str) -> None:
    jinja = render(TEMPLATES[name], CONVERSATION, bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
    assert _go(go_template(name, "</s>", "<s>"), CONVERSATION) == jinja
    # control: the renderer tells templates apart (another template's translation renders other text)
    other = next(n for n in sorted(TEMPLATES) if n != name)
    assert _go(go_template(other, "</s>", "<s>"), CONVERSATION) != jinja


@pytest.mark.slow
def test_a_chatml_run_exports_a_modelfile(tmp_path: Path, tiny_model: Path, soup, capsys) -> None:
    from soup_core.testing import train_in_process, write_jsonl

    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 4
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    train_in_process({"data": {"train": str(data), "max_length": 128, "chat_template": "chatml"},
                      "training": {"batch_size": 4, "max_steps": 1, "lora": {"r": 0}}},
                     workdir=tmp_path, default_base=tiny_model)
    folder = tmp_path / "ollama"
    assert soup("export", "latest", "--to", "ollama", "--type", "q8_0", "-o", folder) == 0
    files = sorted(p.name for p in folder.iterdir())
    gguf_name = next(f for f in files if f.endswith(".gguf"))
    assert files == sorted(["Modelfile", "README.md", gguf_name]) and gguf_name.endswith("-q8_0.gguf")
    text = (folder / "Modelfile").read_text(encoding="utf-8")
    assert text.startswith(f"FROM ./{gguf_name}\nTEMPLATE \"\"\"{go_template('chatml', '', '')}\"\"\"\n")
    assert 'PARAMETER stop "<|im_end|>"' in text
    assert "ollama create NAME -f Modelfile" in (folder / "README.md").read_text(encoding="utf-8")


#: SmolLM2-135M-Instruct's own chat template (as its GGUF file and tokenizer carry it): chatml, with a default
#: system message when a conversation has none.
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
           "<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_base_template_that_renders_as_a_shipped_one_is_translated(tmp_path: Path) -> None:
    import json

    from soup_plugin_gguf.ollama import OllamaError, modelfile, recognise

    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert recognise(SMOLLM2, "<|im_end|>", "") == ("chatml", system)
    assert recognise(TEMPLATES["chatml"], "<|im_end|>", "") == ("chatml", None)
    # controls: one character of the markup changed, or the default system message put after the user's turn
    changed = SMOLLM2.replace("'\n' + message['content']", "': ' + message['content']")
    assert changed != SMOLLM2 and recognise(changed, "<|im_end|>", "") is None
    assert recognise(SMOLLM2.replace("loop.first", "loop.last"), "<|im_end|>", "") is None

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": SMOLLM2, "eos_token": "<|im_end|>"}))
    text = modelfile(folder, "model.gguf", None)
    assert f'SYSTEM """{system}"""' in text and go_template("chatml", "<|im_end|>", "") in text
    assert _go(go_template("chatml", "<|im_end|>", ""), [{"role": "system", "content": system}, *CONVERSATION[1:]]) == \
        render(SMOLLM2, CONVERSATION[1:], add_generation_prompt=True)  # what Ollama renders with SYSTEM in place
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": SMOLLM2.replace("im_start", "im_go"),
                                                              "eos_token": "<|im_end|>"}))
    with pytest.raises(OllamaError, match="nor renders as one"):
        modelfile(folder, "model.gguf", None)
