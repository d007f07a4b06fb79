"""``soup unlearn eval``: a finished run's forget-set and retain-set loss, starting model vs unlearned.

Reads the run's saved config and output folder from the tracker, rebuilds its forget and retain rows with
the core's data pipeline, loads the base with the run's adapter (one copy: the starting model is the
adapter switched off), and measures both. Imports torch when :func:`evaluate_run` runs.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any


class EvalError(Exception):
    """The run cannot be evaluated; the message says why and how to fix it."""


def _find_run(ref: str, tracker: Any) -> Any:
    import soup_core

    try:
        record = tracker.get_run(ref)
    except soup_core.AmbiguousRunError as exc:
        raise EvalError(str(exc)) from exc
    if record is None:
        raise EvalError(
            f"no run {ref!r} in the tracker ({soup_core.soup_home()}); list runs with `soup runs`"
        )
    if record.task != "unlearn":
        raise EvalError(f"run {record.run_id} is a {record.task!r} run, not an unlearn run")
    return record


def _adapter_dir(record: Any) -> Path:
    if not record.output_dir:
        raise EvalError(f"run {record.run_id} recorded no output folder")
    out = Path(record.output_dir)
    # rmu's published recipe trains the MLPs themselves: its output is a whole model folder, no adapter
    whole = _trains_mlps(record)
    wanted = "config.json" if whole else "adapter_config.json"
    if not (out / wanted).is_file():
        why = "did not finish" if record.status != "completed" else "has no trained model there"
        raise EvalError(
            f"run {record.run_id} ({record.status}) {why}: {out} holds no {wanted}; evaluate a completed run"
        )
    return out


def _trains_mlps(record: Any) -> bool:
    training = record.config.get("training") or {}
    return training.get("unlearn_method") == "rmu" and training.get("unlearn_rmu_params", "mlp") == "mlp"


def _base_path(record: Any, adapter: Path) -> str:
    """The run's base model: as written in its config when that still resolves, else the path PEFT
    recorded in the adapter."""
    base = str(record.config.get("base") or record.base_model)
    if Path(base).expanduser().exists() or not base.startswith((".", "/", "~")):
        return str(Path(base).expanduser())
    saved = None
    if (adapter / "adapter_config.json").is_file():
        saved = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8")).get(
            "base_model_name_or_path"
        )
    if saved and Path(saved).exists():
        return str(saved)
    raise EvalError(f"the run's base model {base!r} is not there any more; restore it to evaluate the run")


def _rows(record: Any) -> dict[str, Any]:
    import soup_core
    from soup_plugin_unlearn.task import UnlearnTask

    data = dict(record.config.get("data") or {})
    formats = dict(soup_core.load_plugins().data_formats.items())
    lists: dict[str, Any] = {}
    for key in ("forget", "retain"):
        if not data.get(key):
            continue
        try:
            lists[key] = soup_core.build_training_list(
                data, formats=formats, key=key, accepted=UnlearnTask.formats
            )
        except soup_core.DataError as exc:
            fix = getattr(exc, "fix", "")
            raise EvalError(
                f"cannot rebuild data.{key} of run {record.run_id}: {exc}" + (f" ({fix})" if fix else "")
            ) from exc
    if "forget" not in lists:
        raise EvalError(f"run {record.run_id} names no data.forget in its saved config")
    return lists


def _load_base_as_the_run_did(record: Any, base: str) -> Any:
    """The run's base, loaded by the core's own loader with the run's saved ``training.dtype`` and
    ``training.quantization``: the starting model the run measured, not a float32 stand-in (a 4-bit run's
    starting losses differ from the float32 base's)."""
    import torch

    from soup_core.config import ConfigError, validate_config
    from soup_core.default_plugins.transformers import BackendError, load_model_and_tokenizer

    saved = dict(record.config)
    training = saved.get("training") or {}
    quant = training.get("quantization") or "none"
    how = f"training.dtype {training.get('dtype', 'auto')}, training.quantization {quant}"
    try:
        config = validate_config({**saved, "base": base}, source=f"the saved config of run {record.run_id}")
    except ConfigError as exc:
        raise EvalError(
            f"cannot load the base of run {record.run_id} the way the run did: its saved config does not "
            f"validate with the plugins installed now ({exc}); install the plugins the run used"
        ) from exc
    try:
        model = load_model_and_tokenizer(config).model
    except (BackendError, ImportError, OSError, RuntimeError, ValueError) as exc:
        raise EvalError(
            f"run {record.run_id} trained on its base loaded with {how}, and it cannot be loaded that way "
            f"here: {exc}. Evaluating another precision would report other numbers than the run's; run "
            "`soup unlearn eval` where the run's loading works (for quantization: bitsandbytes installed, "
            "and a GPU where it needs one)"
        ) from exc
    if quant == "none":  # a quantized model is placed by its loader and cannot be moved
        model = model.to("cuda" if torch.cuda.is_available() else "cpu")
    return model


def evaluate_run(
    ref: str = "latest", *, tracker: Any = None, recall: bool = False, batch_size: int = 16
) -> dict[str, Any]:
    """Measure run ``ref`` (an id, a unique prefix or ``latest``): ``{"run_id", "output_dir", "rows",
    "start", "end"}``, ``start``/``end`` mapping ``<set>_loss`` (and ``<set>_recall``) to numbers."""
    import soup_core

    record = _find_run(ref, tracker or soup_core.Tracker())
    adapter = _adapter_dir(record)
    lists = _rows(record)
    base = _base_path(record, adapter)

    from peft import PeftModel
    from transformers import AutoTokenizer

    from soup_plugin_unlearn.evaluate import measure, measure_start_and_now

    data = record.config.get("data") or {}
    from soup_core.default_plugins.transformers import resolve_base

    # a GGUF base is loaded (below, by the core's loader) from its dequantised folder, tokenizer included
    tok_source = adapter if (adapter / "tokenizer_config.json").is_file() else Path(resolve_base(base))
    tokenizer = AutoTokenizer.from_pretrained(str(tok_source))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # loading bars would garble the table's terminal
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' own deprecations, not the user's
            model = _load_base_as_the_run_did(record, base)
            if _trains_mlps(record):  # the unlearned model is a whole folder, loaded the same way
                trained = _load_base_as_the_run_did(record, str(adapter))
            else:
                model, trained = PeftModel.from_pretrained(model, str(adapter)), None
    finally:
        if bars:
            hf_logging.enable_progress_bar()

    def encode(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from soup_core.default_plugins.sft import encode_rows

        return encode_rows(
            rows,
            tokenizer,
            max_length=int(data.get("max_length", 1024)),
            train_on_responses_only=bool(data.get("train_on_responses_only", True)),
        )

    sets = {}
    for key, training in lists.items():
        sets[key] = encode(training.rows)
        if training.val_rows:
            sets[f"{key}_heldout"] = encode(training.val_rows)
    pad = int(tokenizer.pad_token_id)
    if trained is None:
        start, end = measure_start_and_now(model, sets, pad, recall=recall, batch_size=batch_size)
    else:
        start = measure(model, sets, pad, recall=recall, batch_size=batch_size)
        del model
        end = measure(trained, sets, pad, recall=recall, batch_size=batch_size)
    return {
        "run_id": record.run_id,
        "output_dir": str(adapter),
        "method": (record.config.get("training") or {}).get("unlearn_method"),
        "rows": {name: len(rows) for name, rows in sets.items()},
        "start": start,
        "end": end,
    }


def _fmt(value: float | None, *, percent: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{100 * value:.0f}%" if percent else f"{value:.4f}"


def render(result: dict[str, Any], console: Any) -> None:
    """Print the result as a table: one line per set, starting model vs unlearned."""
    from rich.table import Table

    from soup_plugin_unlearn.evaluate import SET_ORDER

    start, end = result["start"], result["end"]
    recall = any(key.endswith("_recall") for key in end)
    table = Table(title=f"unlearn eval: run {result['run_id']} ({result.get('method') or '?'})")
    table.add_column("set")
    table.add_column("rows", justify="right")
    table.add_column("loss, start", justify="right")
    table.add_column("loss, unlearned", justify="right")
    table.add_column("change", justify="right")
    if recall:
        table.add_column("recall, start", justify="right")
        table.add_column("recall, unlearned", justify="right")
    for name in SET_ORDER:
        if name not in result["rows"]:
            continue
        before, after = start.get(f"{name}_loss"), end.get(f"{name}_loss")
        change = f"{after - before:+.4f}" if before is not None and after is not None else "-"
        cells = [name.replace("_", " "), str(result["rows"][name]), _fmt(before), _fmt(after), change]
        if recall:
            cells += [
                _fmt(start.get(f"{name}_recall"), percent=True),
                _fmt(end.get(f"{name}_recall"), percent=True),
            ]
        table.add_row(*cells)
    console.print(table)
    console.print(
        f"trained model: {result['output_dir']}; loss is the mean next-token loss over each set's answer tokens"
    )
