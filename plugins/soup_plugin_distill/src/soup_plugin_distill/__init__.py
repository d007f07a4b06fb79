"""Soup's ``distill`` plugin: train a student on its own cross-entropy plus a temperature-softened
divergence from a frozen teacher's next-token distribution.

Import-light: nothing heavy is imported here; the kernel (:mod:`soup_plugin_distill.loss`) and the
trainer (:mod:`soup_plugin_distill.trainer`) import torch and trl when they are imported.
"""

from __future__ import annotations

__version__ = "0.1.0"
