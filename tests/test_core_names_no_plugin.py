"""The core never names a task or backend other than its built-ins (sft, transformers) (docs/architecture.md).

The exceptions: the install-hint table in soup_core/config/known.py, whose job is to say which
first-party plugin provides a key the user wrote (issue 2, point 6), and `soup doctor`, which reports
whether an MLX device is there (issue 12)."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "soup_core"
# doctor reports the MLX device
EXEMPT = {CORE / "config" / "known.py", CORE / "default_plugins" / "commands" / "doctor.py"}
FOREIGN = {"mlx", "grpo", "dpo", "ipo", "kto", "orpo", "simpo", "cpo", "bco", "ppo", "unlearn", "distill",
           "classification", "reward_model", "pretrain"}


def foreign_names(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in FOREIGN:
            found.append(node.value)
    return found


def test_core_names_no_foreign_task_or_backend() -> None:
    offenders = {}
    for path in CORE.rglob("*.py"):
        if path in EXEMPT:
            continue
        names = foreign_names(path.read_text(encoding="utf-8"))
        if names:
            offenders[str(path.relative_to(CORE))] = names
    assert offenders == {}


def test_control_the_scan_detects_a_named_task() -> None:
    assert foreign_names('if config.task == "grpo":\n    pass\n') == ["grpo"]
    assert foreign_names('backend = "mlx"\n') == ["mlx"]
