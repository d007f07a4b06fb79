"""``soup eval --tasks``: benchmarks through lm-evaluation-harness, handed the loaded model object.

lm-eval is an optional extra (``pip install "soup-plugin-eval[harness]"``). The target is loaded as ``soup
generate`` loads it (the run's base, adapter and tokenizer with its chat template), and lm-eval's ``HFLM`` wraps
that object, so what is scored is exactly the trained model. ``--include-path`` adds a folder of task YAML
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


def run_tasks(targets: list[str], tasks: list[str], *, include_path: Path | None, limit: int | None,
              batch_size: int) -> list[tuple[Any, dict[str, dict[str, Any]]]]:
    """Each target's lm-eval results: task -> metric -> value (``<metric>_stderr`` beside each)."""
    manager = _task_manager(include_path, tasks)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        where = f" or in {include_path}" if include_path else "; add a folder of task YAML files with --include-path"
        raise TargetError(f"--tasks: no lm-eval task named {', '.join(unknown)} among lm-eval's own{where}")
    from lm_eval import simple_evaluate

    from soup_plugin_eval.cli import load_target

    results = []
    for spec_text in targets:
        spec, loaded = load_target(spec_text)
        if loaded.engine != "transformers":
            raise TargetError(f"{spec.label}: lm-evaluation-harness scores transformers models; convert the mlx "
                              "adapter first: soup export ADAPTER --to peft -o OUT")
        out = simple_evaluate(model=harness_model(loaded, batch_size), tasks=tasks, task_manager=manager,
                              limit=limit, log_samples=False)
        per_task = {task: {key.split(",")[0]: value
                           for key, value in metrics.items() if key != "alias" and "," in key}
                    for task, metrics in out["results"].items()}
        results.append((spec, per_task))
        del loaded
    return results
