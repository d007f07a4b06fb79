"""The rl plugin's errors, in a module of their own that imports nothing: the probes, the variant planner,
the trl config builder and the trainers all raise them without importing one another."""

from __future__ import annotations


class CapabilityError(RuntimeError):
    """The installed trl lacks something a task needs; the message says what and where it looked."""
