"""Soup's configuration: one YAML file validated into one :class:`SoupConfig` (docs/config.md).

Plugins add fields through ``soup_register_config_fields`` and say which fields a (backend, task) pair
honours through ``soup_register_support``; :class:`ConfigSchema` assembles both with the core models.
Loading never raises anything but :class:`ConfigError` for a bad config, which carries every issue.

Import-light: pydantic and PyYAML only.
"""

from __future__ import annotations

from soup_core.config.errors import ConfigError, ConfigIssue
from soup_core.config.schema import (
    ALWAYS_HONOURED,
    ConfigSchema,
    DataConfig,
    LoraConfig,
    SoupConfig,
    TrainingConfig,
    core_field_paths,
)
from soup_core.config.validate import (
    config_to_dict,
    dump_config_yaml,
    is_default,
    load_config,
    load_config_text,
    resolve_schema,
    validate_config,
)

__all__ = ["ALWAYS_HONOURED", "ConfigError", "ConfigIssue", "ConfigSchema", "DataConfig", "LoraConfig", "SoupConfig",
           "TrainingConfig", "config_to_dict", "core_field_paths", "dump_config_yaml", "is_default", "load_config",
           "load_config_text", "resolve_schema", "validate_config"]
