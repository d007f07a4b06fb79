"""The config error type: every problem found in one config, rendered as plain text."""

from __future__ import annotations

from dataclasses import dataclass

ROOT = "<root>"


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config.

    ``path`` is the dotted key (``training.lora.r``; ``training.report_to[1]`` for a list item) or
    ``<root>`` for the document itself; ``suggestion`` is the nearest valid key by full dotted path;
    ``install`` is the pip command that brings the missing plugin; ``line``/``column`` are 1-based
    positions in the YAML source when known.
    """

    path: str
    message: str
    suggestion: str | None = None
    install: str | None = None
    line: int | None = None
    column: int | None = None

    def render(self, source: str) -> str:
        """This issue as one line (plus an install line when there is a command)."""
        where = self.path
        if self.path == ROOT:
            where = source if self.line is None else f"{source} line {self.line}, column {self.column or 1}"
        text = f"{where}: {self.message}"
        if self.suggestion:
            text += f" — did you mean {self.suggestion}?"
        if self.line is not None and self.path != ROOT:
            text += f" (line {self.line})"
        if self.install:
            text += f"\n      install: {self.install}"
        return text


class ConfigError(Exception):
    """A config that cannot be used. Carries every issue found, not just the first."""

    def __init__(self, issues: list[ConfigIssue], source: str = "<string>") -> None:
        self.issues = list(issues)
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        """The full human message: a count line, then one line per issue."""
        count = len(self.issues)
        lines = [f"{self.source}: {count} error{'s' if count != 1 else ''}"]
        lines += ["  " + issue.render(self.source) for issue in self.issues]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

    def __reduce__(self) -> tuple[type[ConfigError], tuple[list[ConfigIssue], str]]:
        # Picklable with its issues (it may cross a process boundary under a multi-process launcher).
        return (ConfigError, (self.issues, self.source))
