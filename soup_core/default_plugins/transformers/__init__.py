"""The built-in transformers backend. Import-light: the engine is imported when a run is prepared."""

from soup_core.default_plugins.transformers.backend import HONOURED_FIELDS, PreparedRun, TransformersBackend
from soup_core.default_plugins.transformers.loading import BackendError, load_model_and_tokenizer, merge_adapter

__all__ = [
    "HONOURED_FIELDS",
    "BackendError",
    "PreparedRun",
    "TransformersBackend",
    "load_model_and_tokenizer",
    "merge_adapter",
]
