"""``soup merge``: fold a trained LoRA adapter into its base model and write a plain model folder."""

from __future__ import annotations

from pathlib import Path

import typer


def merge(
    adapter: Path = typer.Argument(..., help="The adapter folder a LoRA run wrote (its output dir)."),
    output: Path = typer.Option(..., "--output", "-o", help="Where to write the merged model (new or empty)."),
    base: str | None = typer.Option(None, "--base", help="The base model; default: the one the adapter "
                                    "records (base_model_name_or_path in adapter_config.json)."),
) -> None:
    """Merge a LoRA adapter into its base model (in fp32, no rounding added) and save a model folder that
    transformers loads without peft.

    Exit codes: 0 merged; 1 not an adapter folder, base not found, or output not empty."""
    from rich.markup import escape

    from soup_core.ui import console, print_error

    def fail(message: str) -> None:
        print_error(message)
        raise typer.Exit(1)

    config_file = adapter / "adapter_config.json"
    if not adapter.exists():
        fail(f"{adapter}: no such folder; give the output folder of a LoRA run (soup runs show RUN names it)")
    if not config_file.is_file():
        fail(f"{adapter} holds no LoRA adapter (adapter_config.json is missing). A run with "
             "training.lora.r: 0 saves a full model, which needs no merge.")
    import json

    try:
        adapter_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        fail(f"cannot read {config_file}: {exc}")
    if not isinstance(adapter_config, dict) or "peft_type" not in adapter_config:
        fail(f"{adapter} is not a PEFT adapter (adapter_config.json has no peft_type); an adapter written by "
             "the mlx backend converts with `soup export ADAPTER --to peft -o OUT` first.")
    recorded = adapter_config.get("base_model_name_or_path")
    if base is None:
        base = recorded
        if not base:
            fail(f"{config_file} does not say which base model it belongs to; pass --base")
    elif recorded and base != recorded:
        console.print(f"note: merging onto --base {escape(base)}, not the base the adapter was trained on "
                      f"({escape(str(recorded))})")
    from soup_core.default_plugins.transformers.checks import base_problem

    problem = base_problem(base, what="--base" if base != recorded else f"the adapter's base ({config_file})")
    if problem:
        fail(problem + ("" if base != recorded else "; if the base moved, pass --base with its new place"))
    from soup_core.default_plugins.transformers.loading import BackendError, merge_adapter

    console.print(f"merging: loading {escape(str(base))} in fp32, adding the adapter, saving to "
                  f"{escape(str(output))} ...")
    try:
        out = merge_adapter(base, adapter, output)
    except (BackendError, OSError, ValueError) as exc:
        fail(str(exc))
    console.print(f"Merged {escape(str(adapter))} into {escape(str(base))} → {escape(str(out))}")
