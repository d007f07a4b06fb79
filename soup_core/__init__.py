"""Soup's core: the hook contract a plugin implements and the few core services plugins use.

``__all__`` is the whole public API of this module (docs/plugins.md, "Public API only"). Importing it loads
pluggy and the contract classes only; the services are loaded on first use. The transformers backend, the
sft task, the formats, the tracker recorder and the commands are default plugins, imported from their own
modules (:mod:`soup_core.default_plugins`). A name this module exported before is still resolved, with a
``DeprecationWarning`` naming its new module, for the whole 0.x line (docs/plugins.md, "Migration").
"""

import importlib as _importlib
import warnings as _warnings

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
from soup_core.default_plugins.moved import install as _install_moved
from soup_core.events import MicroBatch, OptimizerStep, RunEnd, RunStart
from soup_core.hookspecs import HOOK_API_VERSION, hookimpl

__version__ = "0.1.0"
_install_moved()  # the modules that became default plugins keep their old names (soup_core.tiny, ...)

# the core services plugins use: name -> module, imported on first use so `import soup_core` stays cheap
_LAZY = {
    "probes": "soup_core.probes",
    "load_plugins": "soup_core.plugins",
    "PluginSet": "soup_core.plugins",
    "load_config": "soup_core.config",
    "ConfigError": "soup_core.config",
    "Tracker": "soup_core.tracker",
    "soup_home": "soup_core.tracker",
    "AmbiguousRunError": "soup_core.tracker",
    "build_training_list": "soup_core.data",
    "DataError": "soup_core.data",
    "micro_batches": "soup_core.data",
    "row_text": "soup_core.data",
    "console": "soup_core.ui",
    "ProgressLine": "soup_core.progress",
    "atomic_write": "soup_core.io",
}

_TRANSFORMERS = "soup_core.default_plugins.transformers"
#: names this module exported before hook API 1's contract was made small -> the module that exports them now
_MOVED = {
    **dict.fromkeys(
        ("HONOURED_FIELDS", "SoupTrainerMixin", "SoupSFTTrainer", "TrainerSetup", "RowCollator", "row_sums",
         "datasets_for", "BackendError", "resolve_target_modules", "resolve_dtype", "apply_lora",
         "load_model_and_tokenizer", "build_tiny_model", "tiny_model_dir"),
        _TRANSFORMERS,
    ),
    **dict.fromkeys(("SFTTask", "encode_rows", "encode_example", "EncodingError"), "soup_core.default_plugins.sft"),
    "ConfigIssue": "soup_core.config",
    **dict.fromkeys(("RunRecord", "tracked_run", "RunStopped", "TrackerError"), "soup_core.tracker"),
    **dict.fromkeys(("TrainingList", "fingerprint_rows", "summarize", "epoch_order"), "soup_core.data"),
}
_warned: set[str] = set()

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


def __getattr__(name: str) -> object:
    if name in _LAZY:
        module = _importlib.import_module(_LAZY[name])
        return module if name == "probes" else getattr(module, name)
    if name in _MOVED:
        if name not in _warned:
            _warned.add(name)
            _warnings.warn(
                f"soup_core.{name} is deprecated: import it from {_MOVED[name]} "
                f"(from {_MOVED[name]} import {name}); the old name works until soup-core 1.0",
                DeprecationWarning,
                stacklevel=2,
            )
        return getattr(_importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'soup_core' has no attribute {name!r}")
