"""The ``mlx`` backend class. Import-light: the plugin registers it at every ``soup`` start; the training
loop (and mlx) is imported when a run starts."""

from __future__ import annotations

from typing import Any

from soup_core import Backend
from soup_plugin_mlx.errors import BACKEND_NAME, MLXBackendError

__all__ = ["MLXBackend", "MLXBackendError"]


class MLXBackend(Backend):
    """Trains with Apple's MLX and mlx-lm (LoRA or full fine-tuning), on the core's row order."""

    name = BACKEND_NAME
    description = "Apple MLX + mlx-lm (LoRA or full fine-tuning; Metal on Apple silicon, else CPU)"
    multi_process = False  # soup train --nproc N is refused before anything is launched
    runs_watchdog = True  # the non-finite rule runs in its trainer; its pre-flight says the rest is off

    def train(self, context: Any) -> dict[str, Any]:
        """Run one training run; returns its summary (status, steps, losses, tokens/s, ...)."""
        from soup_plugin_mlx import blas

        blas.activate()  # before the training loop imports mlx (soup_plugin_mlx.blas says why)
        from soup_plugin_mlx.trainer import MLXRun

        return MLXRun(context).run()
