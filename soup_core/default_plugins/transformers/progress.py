"""The progress line (:class:`soup_core.progress.ProgressLine`) started and closed by the Trainer's
callbacks; the trainer reports each optimizer step to :meth:`~soup_core.progress.ProgressLine.update`."""

from __future__ import annotations

from transformers import TrainerCallback

from soup_core.progress import ProgressLine


class ProgressDisplay(ProgressLine, TrainerCallback):
    """The core's progress line as a ``TrainerCallback`` (rank 0 only)."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.start(int(state.max_steps or 0), int(state.global_step or 0))

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
