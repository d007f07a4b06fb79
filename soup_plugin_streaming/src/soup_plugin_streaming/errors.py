"""The one error type this plugin raises for a problem the user can fix, and the tripwire's own."""

from __future__ import annotations


class StreamingError(RuntimeError):
    """Streaming cannot go on for a reason the user can fix; the message says what, where and how."""


class SchedulerBug(RuntimeError):
    """A buffer was asked for a layer it no longer holds. Computing on would use the wrong weights, so the
    run stops instead. This is a defect in the prefetch schedule, never a user error."""
