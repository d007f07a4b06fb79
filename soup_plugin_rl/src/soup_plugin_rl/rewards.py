"""Reward functions for grpo (``training.reward_fn``): built-in ones, or a function from a file the
config names.

``training.reward_fn`` is one name or a list; each is a built-in (``accuracy``, ``format``, ``length``)
or ``path/to/file.py:function``. A user function is loaded only from the file the config names, by path
(a relative path against the working directory); nothing is imported by module name. trl calls each
function once per generation batch as
``fn(prompts=..., completions=..., completion_ids=..., answer=..., **other_columns)`` and it returns one
float (or None) per completion, so a user function should accept ``**kwargs``.

Import-light: pure Python.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BUILTIN_REWARDS = ("accuracy", "format", "length")

#: The ``format`` reward's pattern: reasoning in <think>…</think>, then the answer in <answer>…</answer>.
FORMAT_PATTERN = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


class RewardError(ValueError):
    """A reward function cannot be found or loaded; the message says what, where and how to fix it."""


def _text(completion: Any) -> str:
    """A completion as text: trl passes strings for text prompts, message lists for chat prompts."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def _normalise(text: str) -> str:
    return " ".join(text.split())


def accuracy(
    completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion, whitespace-normalised, equals the row's answer exactly, else 0.0; None (no
    reward) for a row without an answer."""
    answers = list(answer) if answer is not None else [None] * len(completions)
    out: list[float | None] = []
    for completion, expected in zip(completions, answers, strict=True):
        if expected is None:
            out.append(None)
        else:
            out.append(1.0 if _normalise(_text(completion)) == _normalise(str(expected)) else 0.0)
    return out


def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the whole completion matches :data:`FORMAT_PATTERN`, else 0.0."""
    pattern = re.compile(FORMAT_PATTERN, re.DOTALL)
    return [1.0 if pattern.fullmatch(_text(c)) else 0.0 for c in completions]


format_reward.__name__ = "format"


def length_reward(max_tokens: int) -> Callable[..., list[float]]:
    """The ``length`` reward: ``1 - tokens / max_tokens`` for each completion (shorter is better, in
    [0, 1] when generation stops at ``max_tokens``)."""

    def length(
        completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None = None, **kwargs: Any
    ) -> list[float]:
        if completion_ids is None:
            raise RewardError("the length reward needs completion_ids, which this trl does not pass")
        return [1.0 - len(ids) / max_tokens for ids in completion_ids]

    return length


# ------------------------------------------------------------------------------------------ user functions


def split_spec(spec: str) -> tuple[str, str]:
    """``path.py:function`` → (path, function); raises :class:`RewardError` for anything else."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier() or not path.endswith(".py"):
        raise RewardError(
            f"training.reward_fn: {spec!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor "
            "'path/to/file.py:function_name'"
        )
    return path, name


def _resolve(path: str, base_dir: Path | None) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base_dir or Path.cwd()) / p


def check_spec(spec: str, base_dir: Path | None = None) -> None:
    """Check a reward spec without running any user code: a built-in name, or a file that exists, parses,
    and defines the function at its top level. Raises :class:`RewardError`."""
    if spec in BUILTIN_REWARDS:
        return
    path, name = split_spec(spec)
    file = _resolve(path, base_dir)
    if not file.is_file():
        raise RewardError(
            f"training.reward_fn: {spec!r}: no such file {file}; give the path of your .py file"
        )
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    except (SyntaxError, UnicodeDecodeError) as exc:
        raise RewardError(f"training.reward_fn: {file} cannot be parsed: {exc}") from None
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assigned = {
        t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
    }
    if name not in defined | assigned:
        raise RewardError(
            f"training.reward_fn: {file} defines no top-level function {name!r} "
            f"(it defines: {', '.join(sorted(defined)) or 'none'})"
        )


def load_user_function(spec: str, base_dir: Path | None = None) -> Callable[..., Any]:
    """Load ``function`` from ``path.py`` (only that file, by path) and return it."""
    check_spec(spec, base_dir)
    path, name = split_spec(spec)
    file = _resolve(path, base_dir).resolve()
    module_name = f"soup_user_rewards_{abs(hash(str(file))):x}"
    module_spec = importlib.util.spec_from_file_location(module_name, file)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"training.reward_fn: {file} cannot be loaded as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling inside the user's file look it up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise RewardError(f"training.reward_fn: importing {file} raised {type(exc).__name__}: {exc}") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(f"training.reward_fn: {name!r} in {file} is not a function")
    return function


def reward_specs(value: str | Sequence[str]) -> list[str]:
    """``training.reward_fn`` as a list of specs."""
    specs = [value] if isinstance(value, str) else list(value)
    if not specs:
        raise RewardError("training.reward_fn is empty; name at least one reward (e.g. accuracy)")
    return specs


def build_rewards(
    value: str | Sequence[str], *, max_completion_length: int, base_dir: Path | None = None
) -> list[Callable[..., Any]]:
    """The reward functions ``training.reward_fn`` names, in order."""
    out: list[Callable[..., Any]] = []
    for spec in reward_specs(value):
        if spec == "accuracy":
            out.append(accuracy)
        elif spec == "format":
            out.append(format_reward)
        elif spec == "length":
            out.append(length_reward(max_completion_length))
        else:
            out.append(load_user_function(spec, base_dir))
    return out
