"""The ``README.md`` every run writes into its output folder: a Hugging Face model card (YAML metadata, then
Markdown) that says what was trained and how: base, task, backend, the data files with their fingerprint and
row counts, the final and best losses, the run id, the Soup version and the resolved config.

Written after the backend saved the model, so it replaces the boilerplate PEFT and trl write there; written
whole (temp file, then rename) with the permissions of any file the process creates. Import-light.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CARD = "README.md"
# what read_card looks for: the lines run_card writes (change them together; tests/test_model_card.py)
_RUN_ID = re.compile(r"^- run id: `([^`]+)`", re.M)
_DATA_ROW = re.compile(r"^\| `data\.(\w+)` \| .*? \| (\w+) \| `(\w*)` \|", re.M)
_CONFIG = re.compile(r"^## Config\n\n```yaml\n(.*?)\n```", re.S | re.M)


def write_card(folder: Path, text: str) -> Path:
    """``folder/README.md`` written whole, readable as any other output."""
    from soup_core.io import atomic_write

    return atomic_write(Path(folder) / CARD, text)


def _num(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "not measured"
    return f"{value:.4f}"


def _yaml_list(items: list[str]) -> str:
    return "".join(f"\n- {item}" for item in items)


def run_card(
    *,
    config: Mapping[str, Any],
    data: Mapping[str, Any],
    run_id: str,
    losses: Mapping[str, Any],
    status: str,
    version: str,
    base_file: tuple[Any, Any] = (None, None),
) -> str:
    """The card's text. ``config`` is the resolved config as a dict, ``data`` maps each data key to its
    TrainingList, ``losses`` is :meth:`soup_core.tracker.Tracker.loss_summary` of the run, ``base_file`` the
    path and SHA-256 of a GGUF base."""
    import json

    import yaml

    base, task, backend = str(config.get("base")), str(config.get("task")), str(config.get("backend"))
    lora = (config.get("training") or {}).get("lora") or {}
    adapter = backend == "transformers" and int(lora.get("r") or 0) > 0
    meta = f"---\nbase_model: {json.dumps(base)}\n"
    if backend == "transformers":
        meta += f"library_name: {'peft' if adapter else 'transformers'}\n"
    meta += f"tags:{_yaml_list(['soup', task, backend] + (['lora'] if adapter else []))}\n---\n"
    what = "a LoRA adapter for" if adapter else "a fine-tune of"
    lines = [
        f"# {config.get('experiment_name') or run_id}", "",
        f"{what.capitalize()} [`{base}`](https://huggingface.co/{base})" if not Path(base).is_absolute()
        else f"{what.capitalize()} `{base}`",
        f"trained by Soup {version} (task `{task}`, backend `{backend}`).", "",
        *([f"The base is the GGUF file `{base_file[0]}` (SHA-256 `{base_file[1]}`), dequantised by transformers.",
           ""] if base_file[0] else []),
        "## Run", "",
        f"- run id: `{run_id}` (`soup runs show {run_id}`)",
        f"- status: {status}",
        f"- steps: {losses.get('steps', 0)}",
        f"- final loss: {_num(losses.get('last'))}",
        f"- best loss: {_num(losses.get('min'))}"
        + (f" (step {losses['min_step']})" if losses.get("min_step") is not None else ""),
        *(f"- {label} by a controller: {losses[key]}" for key, label in (
            ("rows_excluded", "training rows excluded"), ("updates_skipped", "updates skipped")) if losses.get(key)),
        "",
        "## Data", "",
        "| key | files | format | fingerprint | training rows | validation rows |",
        "|---|---|---|---|---|---|",
    ]
    for key, training in data.items():
        lines.append(f"| `data.{key}` | `{training.source}` | {training.format} | `{training.fingerprint[:16]}` | "
                     f"{training.n_rows} | {training.n_val} |")
    resolved = yaml.safe_dump(dict(config), sort_keys=False, allow_unicode=True).rstrip()
    lines += ["", "## Config", "", "```yaml", resolved, "```", ""]
    return meta + "\n".join(lines)


def merged_card(adapter_card: str | None, *, base: str, adapter: Path, version: str) -> str:
    """The card of a merged model: the adapter's card (when Soup wrote one), its metadata saying the model
    is a plain transformers model now, and a section on the merge."""
    merge = (f"\n## Merge\n\nMerged by `soup merge` (Soup {version}): the LoRA adapter `{adapter}` folded into "
             f"`{base}` in fp32; transformers loads this folder without peft.\n")
    if adapter_card and adapter_card.startswith("---\n") and "tags:\n- soup" in adapter_card:
        head, _, body = adapter_card[4:].partition("\n---\n")
        head = head.replace("library_name: peft", "library_name: transformers").replace("\n- lora", "\n- merged")
        return f"---\n{head}\n---\n{body.rstrip()}\n{merge}"
    import json

    return (f"---\nbase_model: {json.dumps(base)}\nlibrary_name: transformers\ntags:\n- soup\n- merged\n---\n"
            f"# {Path(str(adapter)).name} (merged)\n{merge}")


def read_card(text: str) -> dict[str, Any] | None:
    """What :func:`run_card` wrote into a card (kept through :func:`merged_card`): ``run_id``, ``config`` (the
    resolved config mapping) and ``data`` (``{key: (format, fingerprint prefix)}``), each None or empty when
    the card lacks it. None for a card Soup did not write (PEFT's or trl's boilerplate, a hand-written one)."""
    if not text.startswith("---\n") or "\ntags:\n- soup\n" not in text.partition("\n---\n")[0] + "\n":
        return None
    import yaml

    run_id, block = _RUN_ID.search(text), _CONFIG.search(text)
    try:
        config = yaml.safe_load(block.group(1)) if block else None
    except yaml.YAMLError:
        config = None
    return {"run_id": run_id.group(1) if run_id else None, "config": config if isinstance(config, dict) else None,
            "data": {m.group(1): (m.group(2), m.group(3) or None) for m in _DATA_ROW.finditer(text)}}
