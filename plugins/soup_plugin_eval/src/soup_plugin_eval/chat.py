"""``soup chat``: talk to a trained model, tokens shown as they are generated, the conversation kept.

Import-light: typer at module level; the model when the command runs.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from soup_plugin_eval.cli import EXIT_CODES, TARGET_HELP, Fail, load_target, run_command, status

CHAT_HELP = f"""Chat with a trained model (a run trained on chat rows), through the run's chat template.

\b
  soup chat latest
  soup chat out/checkpoint-40 --system "Answer in one sentence."
  printf 'what is 2 plus 2?\\nand 3 plus 3?\\n' | soup chat RUN > answers.txt

Tokens are printed as they are generated and the conversation is kept: each answer sees the turns before \
it. /reset forgets them (the --system message stays), /exit or Ctrl-D ends, Ctrl-C exits with 130. Greedy \
unless --temperature is above 0. With stdin piped, each input line gets one answer on one line of stdout \
(newlines inside an answer become spaces) and the command exits 0 at the end of the input; commands and blank \
lines get no answer.

{EXIT_CODES} 130 interrupted.
"""


class _Echo:
    """A transformers streamer that prints the answer's text as it is decoded (one line when piped)."""

    def __init__(self, tokenizer: Any, one_line: bool) -> None:
        from transformers import TextStreamer

        echo = self

        class Streamer(TextStreamer):
            def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
                echo.write(text)

        self.streamer = Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.one_line = one_line

    def write(self, text: str) -> None:
        sys.stdout.write(text.replace("\n", " ") if self.one_line else text)
        sys.stdout.flush()


def chat(
    target: str = typer.Argument(..., metavar="TARGET", help=TARGET_HELP),
    system: str | None = typer.Option(None, "--system", help="A system message at the start of the conversation."),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", min=1, help="Most tokens per answer."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0: greedy; above 0: sampling."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Nucleus sampling (with --temperature)."),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling."),
) -> None:
    """Chat with a trained model (see CHAT_HELP)."""

    def body() -> None:
        if top_p < 1.0 and temperature <= 0:
            raise Fail("--top-p samples, so it needs --temperature above 0 (greedy ignores it)", 2)
        from soup_plugin_eval.model import Sampling, generate
        from soup_plugin_eval.prompts import chat_ids

        spec, loaded = load_target(target)
        if not spec.chat:
            raise Fail(f"{spec.label} was trained on {spec.data_format or 'non-chat'} rows, not a conversation; "
                       f"use soup generate {target} -p PROMPT")
        interactive = sys.stdin.isatty()
        start = [{"role": "system", "content": system}] if system else []
        history = list(start)
        echo = _Echo(loaded.tokenizer, one_line=not interactive) if loaded.engine == "transformers" else None
        sampling = Sampling(max_new_tokens, temperature, top_p, seed)
        if interactive:
            status(f"chatting with {spec.label}: /reset forgets the conversation, /exit or Ctrl-D ends")
        while True:
            try:
                line = input("> ") if interactive else sys.stdin.readline()
            except EOFError:
                break
            if not interactive and not line:
                break  # end of the piped input
            line = line.rstrip("\r\n")
            command = line.strip()
            if command == "/exit":
                break
            if command == "/reset":
                history = list(start)
                if interactive:
                    status("(conversation forgotten)")
                continue
            if not command:
                continue
            history.append({"role": "user", "content": line})
            ids = generate(loaded, [chat_ids(history, loaded.tokenizer)], sampling,
                           streamer=None if echo is None else echo.streamer)[0]
            answer = loaded.tokenizer.decode(ids, skip_special_tokens=True)
            if echo is None:  # mlx: printed whole
                sys.stdout.write(answer if interactive else answer.replace("\n", " "))
            sys.stdout.write("\n")
            sys.stdout.flush()
            history.append({"role": "assistant", "content": answer})

    run_command(body)
