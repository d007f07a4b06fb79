"""Reading a config's YAML: syntax errors with line and column, duplicate keys refused, and the line of
every key remembered so that later errors can point at it.

Two deliberate departures from PyYAML's YAML 1.1 resolution, both of which silently change values:
``1e-4`` is a number (1.1 wants ``1.0e-4`` and yields the string ``"1e-4"``), and only ``true``/``false``
are booleans (1.1 also turns ``yes``, ``no``, ``on``, ``off`` into booleans).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from soup_core.config.errors import ROOT, ConfigError, ConfigIssue

Positions = dict[str, tuple[int, int]]  # dotted path -> (line, column), 1-based


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2-style booleans and exponent floats."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _construct_bool(loader: yaml.SafeLoader, node: yaml.Node) -> bool:
    return str(loader.construct_scalar(node)).lower() == "true"


_Loader.add_constructor(_BOOL_TAG, _construct_bool)


def _key_text(node: yaml.Node) -> str:
    return str(node.value) if isinstance(node, yaml.ScalarNode) else "<complex key>"


def _walk(node: yaml.Node, prefix: str, positions: Positions, issues: list[ConfigIssue]) -> None:
    """Record each key's position and refuse duplicate keys (PyYAML would keep the last silently)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = _key_text(key_node)
            path = f"{prefix}.{key}" if prefix else key
            line, column = key_node.start_mark.line + 1, key_node.start_mark.column + 1
            if key in seen:
                message = f"duplicate key (first set on line {seen[key]}; only one may be given)"
                issues.append(ConfigIssue(path, message, line=line, column=column))
                continue
            seen[key] = line
            positions[path] = (line, column)
            _walk(value_node, path, positions, issues)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            path = f"{prefix}[{index}]"
            positions[path] = (item.start_mark.line + 1, item.start_mark.column + 1)
            _walk(item, path, positions, issues)


def _syntax_issue(exc: yaml.YAMLError) -> ConfigIssue:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        if exc.context and exc.problem:
            problem = f"{problem} ({exc.context})"
        if "'\\t'" in problem:
            problem += " — indent with spaces, not tabs"
        if mark is not None:
            return ConfigIssue(ROOT, f"invalid YAML: {problem}", line=mark.line + 1, column=mark.column + 1)
        return ConfigIssue(ROOT, f"invalid YAML: {problem}")
    return ConfigIssue(ROOT, f"invalid YAML: {exc}")


def parse_yaml(text: str, source: str) -> tuple[Any, Positions]:
    """Parse one YAML document. Returns (data, positions); raises :class:`ConfigError` on a syntax
    error, a duplicate key, or several documents in one file."""
    loader = _Loader(text)
    positions: Positions = {}
    try:
        node = loader.get_single_node()
        if node is None:
            return None, positions
        issues: list[ConfigIssue] = []
        _walk(node, "", positions, issues)
        if issues:
            raise ConfigError(issues, source)
        data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError([_syntax_issue(exc)], source) from None
    finally:
        loader.dispose()
    return data, positions
