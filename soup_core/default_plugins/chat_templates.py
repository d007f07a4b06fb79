"""``data.chat_template``: a named chat template Soup ships, or an inline Jinja template, for a base without
one or to replace its own. Checked when the config is validated (it parses, and renders a conversation with
the assistant's text in it); applied to the tokenizer the run loads, so the tokenizer saved beside the model
carries it, and ``soup merge`` and ``soup generate``, which load that tokenizer, render chats as training did.

Every shipped template wraps the assistant's turn in ``{% generation %}`` so that only the answer is trained
(``data.train_on_responses_only``). Newlines are written as ``{{ '\\n' }}``: transformers renders templates
with ``trim_blocks``, which drops a literal newline after a tag.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator

__all__ = ["TEMPLATES", "check", "is_inline", "render", "resolve"]

_NL = "{{ '\\n' }}"

#: name -> Jinja text. Role markers are plain text unless the tokenizer has them as special tokens.
TEMPLATES: dict[str, str] = {
    # <|im_start|>role ... <|im_end|>, one turn a line
    "chatml": (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}" + _NL
        + "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>"
        "{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>{% endif %}" + _NL
        + "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant" + _NL + "{% endif %}"
    ),
    # header ids around the role, an end-of-turn id after each message
    "llama3": (
        "{{ bos_token or '' }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
        "<|end_header_id|>" + _NL + _NL
        + "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}<|eot_id|>"
        "{% endgeneration %}{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>" + _NL + _NL + "{% endif %}"
    ),
    # <|role|> on its own line, the tokenizer's eos after each message
    "zephyr": (
        "{% for message in messages %}<|{{ message['role'] }}|>" + _NL
        + "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token or '' }}"
        "{% endgeneration %}{% else %}{{ message['content'] }}{{ eos_token or '' }}{% endif %}" + _NL
        + "{% endfor %}{% if add_generation_prompt %}<|assistant|>" + _NL + "{% endif %}"
    ),
    # plain words for a base model with no special tokens at all: "User: ...", "Assistant: ..."
    "simple": (
        "{% for message in messages %}{% if message['role'] == 'assistant' %}Assistant: {% generation %}"
        "{{ message['content'] }}{{ eos_token or '' }}{% endgeneration %}" + _NL
        + "{% elif message['role'] == 'system' %}{{ message['content'] }}" + _NL + _NL
        + "{% else %}User: {{ message['content'] }}" + _NL + "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}Assistant: {% endif %}"
    ),
}

_SAMPLE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
           {"role": "assistant", "content": "SOUP-ANSWER-7"}]


def is_inline(value: str) -> bool:
    """An inline template has Jinja in it; anything else is a name."""
    return "{{" in value or "{%" in value


def resolve(value: str | None) -> str | None:
    """The Jinja text for ``data.chat_template`` (a shipped name or inline Jinja); None for none."""
    if value is None:
        return None
    return value if is_inline(value) else TEMPLATES[value]


def render(template: str, messages: list[dict[str, str]], **variables: Any) -> str:
    """Render as transformers does (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``{% generation %}``,
    ``raise_exception``), without importing transformers at config time."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, **variables)


def check(value: str | None) -> str | None:
    """Validate ``data.chat_template``: a shipped name, or Jinja that parses and renders a conversation
    with the assistant's message in it. Raises ``ValueError`` saying what is wrong and how to fix it."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"an empty template; give one of {', '.join(TEMPLATES)}, or Jinja text")
    if not is_inline(value):
        if value not in TEMPLATES:
            raise ValueError(f"{value!r} is not a chat template Soup ships ({', '.join(TEMPLATES)}); give one of "
                             "those names, or the template itself as Jinja text (it contains {{ or {%)")
        return value
    import jinja2

    try:
        rendered = render(value, _SAMPLE, bos_token="<s>", eos_token="</s>", add_generation_prompt=False)
        render(value, _SAMPLE[:2], bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the Jinja template does not parse: {exc.message} (line {exc.lineno} of the "
                         "template); fix the template, or use a shipped one: " + ", ".join(TEMPLATES)) from None
    except Exception as exc:  # noqa: BLE001 - any failure to render is the template's to fix
        raise ValueError(f"the Jinja template fails to render a conversation: {type(exc).__name__}: {exc}; it "
                         "gets `messages` (each with `role` and `content`), `bos_token`, `eos_token` and "
                         "`add_generation_prompt`") from None
    if _SAMPLE[-1]["content"] not in rendered:
        raise ValueError("the Jinja template leaves out the assistant's message (it never renders "
                         "message['content'] for role 'assistant'), so there would be nothing to train on")
    return value


#: the field's type (named as ``"soup_core.default_plugins.chat_templates:ChatTemplate"``)
ChatTemplate = Annotated[str | None, AfterValidator(check)]


def apply(tokenizer: Any, config: Any) -> Any:
    """Give ``tokenizer`` the run's ``data.chat_template`` (when set). Returns the tokenizer."""
    template = resolve(getattr(getattr(config, "data", None), "chat_template", None))
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer
