"""An Ollama ``Modelfile`` for an exported GGUF file: ``FROM`` the file, the run's chat template in Ollama's
template language (Go templates), and the stop tokens from the tokenizer.

Only the chat templates Soup ships (``data.chat_template``: chatml, llama3, zephyr, simple) are translated: the
run's config names the one it trained with (the tokenizer saved beside the model carries it), and each
translation renders the same text as the Jinja template for a conversation (tested). A run that kept its base's
own template is translated when that template renders as a shipped one (SmolLM2's is chatml with a default
system message, which becomes the Modelfile's ``SYSTEM``). Any other template is refused, named, before
anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path


class OllamaError(ValueError):
    """A model whose chat template has no Ollama translation."""


#: shipped template -> (Go template, the text that ends a turn); EOS stands for the tokenizer's eos token text
GO_TEMPLATES: dict[str, tuple[str, str]] = {
    "chatml": ("{{ range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
               "<|im_start|>assistant\n", "<|im_end|>"),
    "llama3": ("BOS{{ range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>"
               "{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "zephyr": ("{{ range .Messages }}<|{{ .Role }}|>\n{{ .Content }}EOS\n{{ end }}<|assistant|>\n", "EOS"),
    "simple": ('{{ range .Messages }}{{ if eq .Role "assistant" }}Assistant: {{ .Content }}EOS\n'
               '{{ else if eq .Role "system" }}{{ .Content }}\n\n{{ else }}User: {{ .Content }}\n{{ end }}{{ end }}'
               "Assistant: ", "EOS"),
}


def _tokenizer_facts(folder: Path) -> tuple[str | None, str, str]:
    """(the chat template, the eos token's text, the bos token's text for the template to write: empty when the
    tokenizer adds it itself), from the saved tokenizer files."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")

    def text(key: str) -> str:
        value = config.get(key)
        return value.get("content", "") if isinstance(value, dict) else value or ""

    bos = text("bos_token")
    if bos and (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        probe = tokenizer.encode("a", add_special_tokens=True).ids
        if probe and probe[0] == tokenizer.token_to_id(bos):
            bos = ""  # the runtime adds it (the GGUF's add_bos_token): the template must not add it twice
    return template, text("eos_token"), bos


#: Conversations a template is recognised on: each with a system message, one with several turns.
_PROBES = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And 2 plus 2?"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Name a colour."}],
]


def recognise(template: str, eos: str, bos: str) -> tuple[str, str | None] | None:
    """(the shipped template ``template`` renders as, the system message it adds when a conversation has none),
    or None when it renders as none of them. Recognised by rendering, not by its text: the same conversations,
    with the generation prompt, must give the same text to the character."""
    import jinja2

    from soup_core.default_plugins.chat_templates import TEMPLATES, render

    def text(jinja: str, messages: list[dict[str, str]]) -> str:
        return render(jinja, messages, add_generation_prompt=True, eos_token=eos, bos_token=bos)

    try:
        name = next((n for n, shipped in TEMPLATES.items()
                     if all(text(template, p) == text(shipped, p) for p in _PROBES)), None)
        if name is None:
            return None
        plain = [{"role": "user", "content": "Name a colour."}]
        got = text(template, plain)
        if got == text(TEMPLATES[name], plain):
            return name, None
        marker = "\x00soup-system\x00"
        prefix, _, suffix = text(TEMPLATES[name], [{"role": "system", "content": marker}, *plain]).partition(marker)
        system = got[len(prefix):len(got) - len(suffix)] if got.startswith(prefix) and got.endswith(suffix) else None
        without = [plain, *(p[1:] for p in _PROBES)]  # the probes less their system messages
        if system is not None and all(text(template, c) == text(TEMPLATES[name], [
                {"role": "system", "content": system}, *c]) for c in without):
            return name, system  # added in front of every conversation without one, as Ollama's SYSTEM is
    except (jinja2.TemplateError, TypeError, ValueError):
        pass
    return None


def go_template(name: str, eos: str, bos: str) -> str:
    """The Ollama template of the shipped template ``name``, with the tokenizer's eos/bos texts in place."""
    return GO_TEMPLATES[name][0].replace("EOS", eos).replace("BOS", bos)


def modelfile(folder: Path, gguf_name: str, name: str | None) -> str:
    """The Modelfile text for ``gguf_name`` (beside it): ``name`` is the run's ``data.chat_template`` (None when
    the run kept its base's template, or no run is known), the eos/bos texts come from the tokenizer in ``folder``."""
    template, eos, bos = _tokenizer_facts(folder)
    system = None
    if name not in GO_TEMPLATES and template is not None and (found := recognise(template, eos, bos)) is not None:
        name, system = found
    if name not in GO_TEMPLATES:
        what = (f"was trained with an inline Jinja chat template ({name[:60]!r}...)" if name else
                f"has a chat template that is not one Soup ships nor renders as one ({template[:60]!r}...)"
                if template else
                "has no chat template")
        raise OllamaError(f"{folder} {what}; --to ollama translates only the templates Soup ships "
                          f"({', '.join(GO_TEMPLATES)}) into Ollama's template language. Train with "
                          "data.chat_template: chatml (or another of those), or export --to gguf and write the "
                          "Modelfile's TEMPLATE yourself")
    stops = list(dict.fromkeys(s for s in (GO_TEMPLATES[name][1].replace("EOS", eos), eos) if s))
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{go_template(name, eos, bos)}"""',
             *([f'SYSTEM """{system}"""'] if system else []), *(f"PARAMETER stop {json.dumps(s)}" for s in stops)]
    return "\n".join(lines) + "\n"
