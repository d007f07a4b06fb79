"""The hooks Soup calls on the ``cloud`` plugin. Imported at every CLI start: it imports nothing heavy; the
work is in :mod:`soup_plugin_cloud.plan`, imported when ``soup train --cloud`` runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from soup_core import hookimpl

#: Hook-API versions this plugin supports (min, max); pyproject.toml's soup-core range matches.
SOUP_HOOK_API = (1, 1)


@hookimpl
def soup_train_elsewhere(config_path: Any, options: dict[str, Any]) -> int | None:
    from soup_plugin_cloud.plan import train_elsewhere

    return train_elsewhere(Path(config_path), options)
