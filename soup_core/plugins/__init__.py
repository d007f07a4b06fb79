"""Plugin discovery, selection and registries."""

from soup_core.capabilities import DISABLED, FAILED, OK, UNAVAILABLE, PluginInfo
from soup_core.plugins.manager import (
    BUILTINS,
    PluginLoadError,
    PluginSelectionError,
    PluginSet,
    build_plugin_set,
    load_plugins,
    reset_cache,
)
from soup_core.plugins.registry import DuplicateNameError, Registry

__all__ = ["BUILTINS", "DISABLED", "FAILED", "OK", "UNAVAILABLE", "DuplicateNameError", "PluginInfo",
           "PluginLoadError", "PluginSelectionError", "PluginSet", "Registry", "build_plugin_set", "load_plugins",
           "reset_cache"]
