"""Soup's core: CLI, config, tracker, data pipeline, hook contract and the built-in transformers/sft.

This module is the public API a plugin may import. It stays light: importing it loads pluggy and the
contract dataclasses only; the config, tracker and data APIs are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from soup_core.contracts import (
    REQUIRED,
    Backend,
    Command,
    ConfigField,
    Controller,
    ControllerAction,
    DataFormat,
    LoadedModel,
    PreflightReport,
    Probe,
    ProbeResult,
    Recorder,
    Rollback,
    SetCoefficient,
    Stop,
    Support,
    Task,
)
from soup_core.events import MicroBatch, OptimizerStep, RunEnd, RunStart
from soup_core.hookspecs import HOOK_API_VERSION, hookimpl

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access so `import soup_core` stays cheap.
_LAZY = {
    # config
    "load_config": "soup_core.config",
    "ConfigError": "soup_core.config",
    "ConfigIssue": "soup_core.config",
    # tracker
    "Tracker": "soup_core.tracker",
    "RunRecord": "soup_core.tracker",
    "soup_home": "soup_core.tracker",
    "tracked_run": "soup_core.tracker",
    "RunStopped": "soup_core.tracker",
    "AmbiguousRunError": "soup_core.tracker",
    "TrackerError": "soup_core.tracker",
    # data
    "build_training_list": "soup_core.data",
    "TrainingList": "soup_core.data",
    "DataError": "soup_core.data",
    "fingerprint_rows": "soup_core.data",
    "micro_batches": "soup_core.data",
    "row_text": "soup_core.data",
    "summarize": "soup_core.data",
    "epoch_order": "soup_core.data",
    # the transformers backend's seams, for task plugins (import torch/transformers/trl when first used)
    "HONOURED_FIELDS": "soup_core.default_plugins.transformers.backend",
    "SoupTrainerMixin": "soup_core.default_plugins.transformers.trainer",
    "SoupSFTTrainer": "soup_core.default_plugins.transformers.trainer",
    "TrainerSetup": "soup_core.default_plugins.transformers.trainer",
    "RowCollator": "soup_core.default_plugins.transformers.trainer",
    "row_sums": "soup_core.default_plugins.transformers.trainer",
    "datasets_for": "soup_core.default_plugins.transformers.trainer",
    "BackendError": "soup_core.default_plugins.transformers.loading",
    "resolve_target_modules": "soup_core.default_plugins.transformers.loading",
    "resolve_dtype": "soup_core.default_plugins.transformers.loading",
    "apply_lora": "soup_core.default_plugins.transformers.loading",
    "load_model_and_tokenizer": "soup_core.default_plugins.transformers.loading",
    "SFTTask": "soup_core.default_plugins.sft",
    "encode_rows": "soup_core.default_plugins.sft",
    "encode_example": "soup_core.default_plugins.sft",
    "EncodingError": "soup_core.default_plugins.sft",
    "build_tiny_model": "soup_core.default_plugins.transformers.tiny",
    "tiny_model_dir": "soup_core.default_plugins.transformers.tiny",
    # plugins
    "load_plugins": "soup_core.plugins",
    "PluginSet": "soup_core.plugins",
    # probes
    "probes": "soup_core.probes",
    # ui
    "console": "soup_core.ui",
    "ProgressLine": "soup_core.progress",
    "atomic_write": "soup_core.io",
}

__all__ = [
    "HOOK_API_VERSION",
    "REQUIRED",
    "Backend",
    "Command",
    "ConfigField",
    "Controller",
    "ControllerAction",
    "DataFormat",
    "LoadedModel",
    "MicroBatch",
    "OptimizerStep",
    "PreflightReport",
    "Probe",
    "ProbeResult",
    "Recorder",
    "Rollback",
    "RunEnd",
    "RunStart",
    "SetCoefficient",
    "Stop",
    "Support",
    "Task",
    "__version__",
    "hookimpl",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'soup_core' has no attribute {name!r}")
    if name == "probes":
        return importlib.import_module(module)
    return getattr(importlib.import_module(module), name)
