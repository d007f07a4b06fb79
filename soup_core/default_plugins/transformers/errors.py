"""The error of the transformers backend (its own module, importing nothing, so that the modules the loader
uses can raise it without importing the loader)."""

from __future__ import annotations


class BackendError(RuntimeError):
    """A run cannot go on for a reason the user can fix; the message says what, where and how."""
