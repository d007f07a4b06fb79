"""See a run: ``soup why`` (how a run ended, why, and what to change), crash bundles (``soup bundle``) and
``soup runs plot``. Everything here reads a run's records (the tracker, its output folder, a bundle) and
imports no torch."""

from __future__ import annotations

__version__ = "0.1.0"
