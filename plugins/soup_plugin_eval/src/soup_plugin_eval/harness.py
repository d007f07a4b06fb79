"""``soup eval --tasks``: benchmarks through lm-evaluation-harness, handed the loaded model object.

lm-eval is an optional extra (``pip install "soup-plugin-eval[harness]"``). The target is loaded as ``soup
generate`` loads it (the run's base, adapter and tokenizer with its chat template), and lm-eval's ``HFLM`` wraps
that object, so what is scored is exactly the trained model; ``--base`` scores the same object with its adapter
turned off first (the base), shown beside it. ``--include-path`` adds a folder of task YAML
files; a task whose ``dataset_path`` is ``json`` over local files runs offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from soup_plugin_eval.target import TargetError

INSTALL = 'pip install "soup-plugin-eval[harness]"'


def _task_manager(include_path: Path | None, tasks: list[str]) -> Any:
    """lm-eval's task index: only ``include_path`` when it defines every task asked for (indexing lm-eval's
    thousands of built-in YAML files takes tens of seconds), else the built-in tasks too."""
    from soup_core import probes

    if not probes.distribution("lm-eval").ok:
        raise TargetError(f"--tasks runs lm-evaluation-harness, which is not installed; {INSTALL}")
    if include_path is not None and not include_path.is_dir():
        raise TargetError(f"--include-path {include_path}: no such folder")
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(task in local.all_tasks for task in tasks):
            return local
    return TaskManager(include_path=str(include_path) if include_path else None)


def harness_model(loaded: Any, batch_size: int) -> Any:
    """lm-eval's ``HFLM`` around the already loaded model and tokenizer."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=batch_size)


def _evaluate(loaded: Any, tasks: list[str], manager: Any, limit: int | None,
              batch_size: int) -> dict[str, dict[str, Any]]:
    """lm-eval's results for one loaded model: task -> metric -> value (``<metric>_stderr`` beside each)."""
    from lm_eval import simple_evaluate

    out = simple_evaluate(model=harness_model(loaded, batch_size), tasks=tasks, task_manager=manager,
                          limit=limit, log_samples=False)
    return {task: {key.split(",")[0]: value for key, value in metrics.items() if key != "alias" and "," in key}
            for task, metrics in out["results"].items()}


def run_tasks(targets: list[str], tasks: list[str], *, include_path: Path | None, limit: int | None,
              batch_size: int, base: bool = False) -> list[tuple[Any, dict[str, dict[str, Any]]]]:
    """Each target's lm-eval results: task -> metric -> value (``<metric>_stderr`` beside each). With ``base``,
    first the base model of the first target (a LoRA adapter): the same loaded model with its adapter turned
    off, so base and trained are scored by one load, one tokenizer and one chat template; its entry's target
    is None."""
    manager = _task_manager(include_path, tasks)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        where = f" or in {include_path}" if include_path else "; add a folder of task YAML files with --include-path"
        raise TargetError(f"--tasks: no lm-eval task named {', '.join(unknown)} among lm-eval's own{where}")
    from soup_plugin_eval.cli import load_target

    results: list[tuple[Any, dict[str, dict[str, Any]]]] = []
    for i, spec_text in enumerate(targets):
        spec, loaded = load_target(spec_text)
        if loaded.engine != "transformers":
            raise TargetError(f"{spec.label}: lm-evaluation-harness scores transformers models; convert the mlx "
                              "adapter first: soup export ADAPTER --to peft -o OUT")
        if base and i == 0:
            if spec.kind != "adapter":
                raise TargetError(f"--base scores the first target's adapter turned off; {spec.label} is a whole "
                                  "model, not a LoRA adapter: give the base's own run as a target instead")
            with loaded.model.disable_adapter():
                results.append((None, _evaluate(loaded, tasks, manager, limit, batch_size)))
        results.append((spec, _evaluate(loaded, tasks, manager, limit, batch_size)))
        del loaded
    return results
