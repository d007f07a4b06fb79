"""Loading and validating a config: every problem is collected into one :class:`ConfigError`."""

from __future__ import annotations

import copy
import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from soup_core.config import known
from soup_core.config.errors import ROOT, ConfigError, ConfigIssue
from soup_core.config.schema import ALWAYS_HONOURED, REQUIRED, ConfigSchema, SoupConfig
from soup_core.config.yaml_io import Positions, parse_yaml

_MISSING = object()
_SCHEMA_CACHE: dict[int, tuple[Any, ConfigSchema]] = {}


# ----------------------------------------------------------------------------------------- schemas


def resolve_schema(plugins: Any = None) -> ConfigSchema:
    """A :class:`ConfigSchema` from ``plugins``: a schema as is, a plugin set (cached per object), or
    None for the installed plugins."""
    if isinstance(plugins, ConfigSchema):
        return plugins
    if plugins is None:
        from soup_core.plugins import load_plugins  # lazy: the plugin manager imports more

        plugins = load_plugins()
    cached = _SCHEMA_CACHE.get(id(plugins))
    if cached is not None and cached[0] is plugins:
        return cached[1]
    schema = ConfigSchema.from_plugins(plugins)
    if len(_SCHEMA_CACHE) > 8:
        _SCHEMA_CACHE.clear()
    _SCHEMA_CACHE[id(plugins)] = (plugins, schema)
    return schema


# --------------------------------------------------------------------------------------- public API


def load_config(
    path: str | os.PathLike[str], *, plugins: Any = None, overrides: Mapping[str, Any] | None = None
) -> SoupConfig:
    """Read and validate the YAML config at ``path``. Raises :class:`ConfigError` with every issue."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([ConfigIssue(ROOT, "file not found")], source) from None
    except IsADirectoryError:
        raise ConfigError([ConfigIssue(ROOT, "is a folder, not a YAML file")], source) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([ConfigIssue(ROOT, f"not UTF-8 text ({exc.reason})")], source) from None
    except OSError as exc:
        raise ConfigError([ConfigIssue(ROOT, f"cannot read the file: {exc.strerror or exc}")], source) from None
    return load_config_text(text, source=source, plugins=plugins, overrides=overrides)


def load_config_text(
    text: str, *, source: str = "<string>", plugins: Any = None, overrides: Mapping[str, Any] | None = None
) -> SoupConfig:
    """Validate a config given as YAML text."""
    data, positions = parse_yaml(text, source)
    if data is None:
        raise ConfigError([ConfigIssue(ROOT, "the config is empty; it needs at least `base: <model>`")], source)
    if not isinstance(data, dict):
        raise ConfigError(
            [ConfigIssue(ROOT, f"the config must be a mapping of keys (like `base: ...`), got {_show(data)}")],
            source,
        )
    return _validate(data, resolve_schema(plugins), overrides, source, positions)


def validate_config(
    mapping: Mapping[str, Any],
    *,
    plugins: Any = None,
    overrides: Mapping[str, Any] | None = None,
    source: str = "<mapping>",
) -> SoupConfig:
    """Validate a config given as a mapping (a saved resolved config, or one built in code)."""
    if not isinstance(mapping, Mapping):
        raise ConfigError([ConfigIssue(ROOT, f"the config must be a mapping, got {_show(mapping)}")], source)
    return _validate(dict(mapping), resolve_schema(plugins), overrides, source, {})


def config_to_dict(config: SoupConfig) -> dict[str, Any]:
    """The full resolved config (defaults included) as JSON-safe data; validates back to an equal config."""
    return config.model_dump(mode="json")


def dump_config_yaml(config: SoupConfig) -> str:
    """The full resolved config as YAML text (key order as in the schema)."""
    import yaml

    return yaml.safe_dump(config_to_dict(config), sort_keys=False, allow_unicode=True)


def is_default(config: SoupConfig, path: str) -> bool:
    """Whether the value at dotted ``path`` equals its default (a section: every field under it does)."""
    model: Any = config
    *parents, leaf = path.split(".")
    for part in parents:
        model = getattr(model, part)
    info = type(model).model_fields[leaf]
    return not info.is_required() and bool(getattr(model, leaf) == info.get_default(call_default_factory=True))


# ------------------------------------------------------------------------------------- validation


def _validate(
    data: dict[str, Any],
    schema: ConfigSchema,
    overrides: Mapping[str, Any] | None,
    source: str,
    positions: Positions,
) -> SoupConfig:
    issues: list[ConfigIssue] = []
    data = copy.deepcopy(data)
    for path, value in (overrides or {}).items():
        problem = _set_path(data, path, value)
        if problem:
            issues.append(ConfigIssue(path, problem))
        for key in [k for k in positions if k == path or k.startswith(path + ".") or k.startswith(path + "[")]:
            del positions[key]  # the file's line no longer describes this value
    _normalise_sections(data, schema, "")

    model = schema.model
    result: SoupConfig | None = None
    failed: set[str] = set()
    try:
        result = model.model_validate(data)
    except ValidationError as exc:
        for issue in _translate(exc.errors(), data, schema, positions):
            failed.add(issue.path)
            issues.append(issue)
    issues += _registry_issues(data, schema, failed, positions)
    if issues:
        issues.sort(key=lambda issue: (issue.line is None, issue.line or 0))
        raise ConfigError(issues, source)
    assert result is not None
    return result


def _set_path(data: dict[str, Any], path: str, value: Any) -> str | None:
    node = data
    *parents, leaf = path.split(".")
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            return f"cannot set this override: {'.'.join(parents[: i + 1])} is not a section"
        node = child
    node[leaf] = value
    return None


def _normalise_sections(data: dict[str, Any], schema: ConfigSchema, prefix: str) -> None:
    """``training:`` with every key commented out parses as null: treat it as an empty section."""
    for key in list(data):
        path = f"{prefix}.{key}" if prefix else str(key)
        if not isinstance(key, str):
            data[str(key)] = data.pop(key)  # YAML allows `1: x`; report it as the unknown key '1'
            key = str(key)
        if schema.is_section(path):
            if data[key] is None:
                data[key] = {}
            if isinstance(data[key], dict):
                _normalise_sections(data[key], schema, path)


def _get_path(data: Any, path: str) -> Any:
    node = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'" if len(value) <= 60 else f"'{value[:57]}...'"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return repr(value)


# ------------------------------------------------------------------------------ pydantic's errors

_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
    "set_type": "a list",
    "dict_type": "a mapping (a section of keys)",
    "model_type": "a mapping (a section of keys)",
    "model_attributes_type": "a mapping (a section of keys)",
    "none_required": "null",
}
_BOUNDS = {
    "greater_than_equal": ("ge", "must be at least {}"),
    "greater_than": ("gt", "must be greater than {}"),
    "less_than_equal": ("le", "must be at most {}"),
    "less_than": ("lt", "must be less than {}"),
}


def _display_path(loc: tuple[Any, ...], data: Any) -> tuple[str, list[str]]:
    """(dotted path, its key parts) for a pydantic ``loc``, walking the input beside it so that
    union-branch tags in ``loc`` (``'int'``, ``"literal['auto']"``) are dropped."""
    text, keys, node = "", [], data
    for part in loc:
        if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            text += f"[{part}]"
            node = node[part]
            continue
        if not isinstance(node, dict):
            continue  # inside a leaf value: a union-branch tag
        node = node.get(part, _MISSING)  # a present key, or a missing required one
        keys.append(str(part))
        text = f"{text}.{part}" if text else str(part)
    return text, keys


def _translate(
    errors: list[Any], data: dict[str, Any], schema: ConfigSchema, positions: Positions
) -> list[ConfigIssue]:
    grouped: dict[str, list[Any]] = {}
    key_parts: dict[str, list[str]] = {}
    for error in errors:
        path, keys = _display_path(tuple(error["loc"]), data)
        grouped.setdefault(path or ROOT, []).append(error)
        key_parts[path or ROOT] = keys
    issues = []
    for path, group in grouped.items():
        line_col = positions.get(path)
        line, column = line_col if line_col else (None, None)
        if group[0]["type"] == "extra_forbidden":
            issues.append(_unknown_key(path, key_parts[path], schema, line, column))
            continue
        message = _message(group)
        entry = re.match(r"(\[\d+\][\w.]*): ", message)  # a list entry's own problem names its own path
        if entry and len(group) == 1:
            path, message = path + entry.group(1), message[entry.end():]
            line, column = positions.get(path, (line, column))
        issues.append(ConfigIssue(path, message, line=line, column=column))
    return issues


def _message(group: list[Any]) -> str:
    expected = []
    for error in group:
        kind = error["type"]
        if kind in _EXPECTED:
            expected.append(_EXPECTED[kind])
        elif kind == "literal_error":
            expected.append("one of " + error["ctx"]["expected"])
    given = group[0].get("input")
    if expected and len(expected) == len(group):
        message = f"expected {' or '.join(dict.fromkeys(expected))}, got {_show(given)}"
        if isinstance(given, str):
            choices = [
                c for e in group if e["type"] == "literal_error" for c in re.findall(r"'([^']*)'", e["ctx"]["expected"])
            ]
            close = difflib.get_close_matches(given, choices, n=1, cutoff=0.6)
            if close:
                message += f" — did you mean '{close[0]}'?"
        return message
    messages = []
    for error in group:
        kind = error["type"]
        if kind in _EXPECTED or kind == "literal_error":
            continue
        if kind == "missing":
            messages.append("required, but not given")
        elif kind in _BOUNDS:
            name, text = _BOUNDS[kind]
            bound = error["ctx"][name]
            if isinstance(bound, float) and bound.is_integer():
                bound = int(bound)  # `gt=0` on a float field reads 0.0; users wrote 0
            messages.append(f"{text.format(bound)}, got {_show(error.get('input'))}")
        elif kind in ("string_too_short", "too_short") and error.get("ctx", {}).get("min_length") == 1:
            messages.append("must not be empty")
        elif kind == "value_error":
            messages.append(str(error["ctx"]["error"]))
        else:
            messages.append(str(error["msg"]))
    return "; ".join(dict.fromkeys(messages))


# --------------------------------------------------------------------------------- unknown keys


def _unknown_key(path: str, keys: list[str], schema: ConfigSchema, line: int | None, column: int | None) -> ConfigIssue:
    prefix, key = ".".join(keys[:-1]), keys[-1]
    dist = known.distribution_for_path(path)
    if dist is not None:
        reason, install = known.absent_reason(dist, schema.not_loaded)
        return ConfigIssue(path, f"unknown key — it comes from {reason}", install=install, line=line, column=column)
    suggestion = _suggest(prefix, key, schema)
    if suggestion is None:
        # A typo of a first-party plugin key: suggest it together with its install command.
        exact = [p for p in known.KNOWN_FIELDS if "*" not in p]
        close = difflib.get_close_matches(path, exact, n=1, cutoff=0.8)
        if close:
            reason, install = known.absent_reason(known.KNOWN_FIELDS[close[0]], schema.not_loaded)
            message = f"unknown key — did you mean {close[0]}? That key comes from {reason}"
            return ConfigIssue(path, message, suggestion=None, install=install, line=line, column=column)
    note = known.not_loaded_note(schema.not_loaded) if suggestion is None else ""
    return ConfigIssue(path, "unknown key" + note, suggestion=suggestion, line=line, column=column)


def _suggest(prefix: str, key: str, schema: ConfigSchema) -> str | None:
    """The nearest valid path for unknown ``key`` under ``prefix``: the same key in another section
    first (``training.max_length`` → ``data.max_length``), then a close key in the same section, then a
    close key anywhere."""
    here = f"{prefix}.{key}" if prefix else key
    every = [p for p in schema.paths(sections=True) if p != here]
    same_name = [p for p in every if p.rsplit(".", 1)[-1] == key]
    if same_name:
        return min(same_name, key=lambda p: (p.count("."), p))
    level = schema.section_keys(prefix)
    close = difflib.get_close_matches(key, level, n=1, cutoff=0.6)
    if close:
        return f"{prefix}.{close[0]}" if prefix else close[0]
    by_name: dict[str, str] = {}
    for p in every:
        by_name.setdefault(p.rsplit(".", 1)[-1], p)
    close = difflib.get_close_matches(key, list(by_name), n=1, cutoff=0.75)
    return by_name[close[0]] if close else None


# ------------------------------------------------------------------ backend, task and support table


def _name_issue(kind: str, value: str, registered: list[str], first_party: Mapping[str, str],
                schema: ConfigSchema) -> ConfigIssue:
    dist = first_party.get(value)
    if dist is not None:
        reason, install = known.absent_reason(dist, schema.not_loaded)
        return ConfigIssue(kind, f"{kind} '{value}' comes from {reason}", install=install)
    names = ", ".join(sorted(registered)) if registered else f"none (no {kind} is registered)"
    # an installed plugin that is not loaded is the likeliest answer: named first, before any guess
    message = f"unknown {kind} '{value}'{known.not_loaded_note(schema.not_loaded)} — registered {kind}s: {names}"
    close = difflib.get_close_matches(value, [*registered, *first_party], n=1, cutoff=0.6)
    if close:
        message += f" — did you mean '{close[0]}'?"
    return ConfigIssue(kind, message)


def _at(issue: ConfigIssue, positions: Positions) -> ConfigIssue:
    if issue.line is not None or issue.path not in positions:
        return issue
    line, column = positions[issue.path]
    return ConfigIssue(issue.path, issue.message, issue.suggestion, issue.install, line, column)


def _registry_issues(
    data: dict[str, Any], schema: ConfigSchema, failed: set[str], positions: Positions
) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    backend = data.get("backend", schema.default("backend"))
    task = data.get("task", schema.default("task"))
    if "backend" in failed or "task" in failed or not isinstance(backend, str) or not isinstance(task, str):
        return issues
    backend_ok, task_ok = backend in schema.backends, task in schema.tasks
    if not backend_ok:
        issue = _name_issue("backend", backend, list(schema.backends), known.KNOWN_BACKENDS, schema)
        issues.append(_at(issue, positions))
    if not task_ok:
        issues.append(_at(_name_issue("task", task, list(schema.tasks), known.KNOWN_TASKS, schema), positions))
    if not (backend_ok and task_ok):
        return issues

    data_keys = tuple(getattr(schema.tasks[task], "data_keys", ()) or ())
    optional = set(getattr(schema.tasks[task], "optional_data_keys", ()) or ())
    for key in data_keys:
        if key not in optional and not _touches(key, failed) and _get_path(data, key) in (_MISSING, None):
            issues.append(ConfigIssue(key, f"required by task '{task}'"))

    honoured = schema.support.get((backend, task))
    if honoured is None:
        offered = sorted(t for b, t in schema.support if b == backend)
        also = f"; backend '{backend}' supports: {', '.join(offered)}" if offered else ""
        message = (
            f"task '{task}' is not supported by backend '{backend}' (the support table has no row for this pair){also}"
        )
        issues.append(_at(ConfigIssue("task", message), positions))
        return issues

    for path in schema.paths():
        if path in ALWAYS_HONOURED or path in data_keys or _touches(path, failed) or schema.is_observer(path):
            continue
        value = _get_path(data, path)
        if value is _MISSING:
            continue
        default = schema.default(path)
        if default is not REQUIRED and _same(value, default):
            continue
        parts = path.split(".")
        if any(".".join(parts[:i]) in honoured for i in range(1, len(parts) + 1)):
            continue
        shown = "" if default is REQUIRED else f" (remove it, or leave it at its default {_show(default)})"
        reason = schema.support_reasons.get((backend, task), {}).get(path)
        why = f": {reason}" if reason else ""
        message = f"not honoured by backend '{backend}' with task '{task}'{why}{shown}"
        issues.append(_at(ConfigIssue(path, message), positions))
    # a file's sampling weight is honoured only where the pair's trainer draws by it ("data.train.weight")
    files = _get_path(data, "data.train")
    weighted = [i for i, e in enumerate(files if isinstance(files, list) else ())
                if isinstance(e, dict) and e.get("weight", 1) != 1]
    if weighted and "data.train.weight" not in honoured and "data.train" not in failed:
        reason = schema.support_reasons.get((backend, task), {}).get("data.train.weight")
        message = f"not honoured by backend '{backend}' with task '{task}'{': ' + reason if reason else ''} (remove it)"
        issues.append(_at(ConfigIssue(f"data.train[{weighted[0]}].weight", message), positions))
    return issues


def _same(value: Any, default: Any) -> bool:
    # In Python 1 == True; here a bool never equals a number.
    return isinstance(value, bool) == isinstance(default, bool) and bool(value == default)


def _touches(path: str, failed: set[str]) -> bool:
    """Whether an error was already reported at ``path``, inside it, or at a section above it."""
    return any(f == path or f.startswith((path + ".", path + "[")) or path.startswith(f + ".") for f in failed)
