"""The ``unlearn`` task (import-light: the trainer and torch are imported by :meth:`UnlearnTask.build`)."""

from __future__ import annotations

from typing import Any, ClassVar

from soup_core.contracts import Backend, Task


class UnlearnTask(Task):
    """Make a model forget ``data.forget`` while keeping ``data.retain``: NPO, SimNPO or RMU on a LoRA
    adapter, the starting model being the base with the adapter switched off."""

    name = "unlearn"
    description = "machine unlearning: forget data.forget (NPO, SimNPO, RMU) while keeping data.retain"
    data_keys = ("data.forget", "data.retain")
    #: Keys of ``data_keys`` the run may go without (the core builds a list only for those that are set).
    optional_data_keys: ClassVar[tuple[str, ...]] = ("data.retain",)
    formats = ("chat", "alpaca", "prompt_completion", "text")
    capabilities = frozenset({"per_row_losses", "reference_by_disabling_adapters"})

    def build(self, backend: Backend, context: Any) -> Any:
        """The trainer for ``backend`` (transformers only); ``context`` is its ``TrainerSetup``."""
        if backend.name != "transformers":
            raise NotImplementedError(f"the unlearn task has no trainer for backend {backend.name!r}")
        from soup_plugin_unlearn.trainer import build_trainer

        return build_trainer(self, context, trainer_class=self.trainer_class())

    def trainer_class(self) -> type:
        """The trainer class :meth:`build` uses (a subclass may return its own)."""
        from soup_plugin_unlearn.trainer import UnlearnTrainer

        return UnlearnTrainer
