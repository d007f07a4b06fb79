"""The ``distill`` task: the student trains on its own cross-entropy plus a divergence from a teacher.

Rows are those of ``sft`` (chat, alpaca, prompt/completion, text), tokenised by sft's
:func:`~soup_core.default_plugins.sft.encode_rows`, so the supervised tokens (``data.train_on_responses_only``)
are the same as for sft. Import-light: the trainer (torch, trl) is imported when a run builds it.
"""

from __future__ import annotations

from typing import Any

from soup_core import Backend
from soup_core.default_plugins.sft import SFTTask


class DistillTask(SFTTask):
    """Knowledge distillation from a frozen teacher that shares the student's tokenizer. Its rows, formats
    and encoding are sft's (``data.max_length``, ``data.train_on_responses_only``)."""

    name = "distill"
    description = "knowledge distillation from a teacher model (forward KL, reverse KL, Jensen-Shannon)"
    capabilities = frozenset({"per_row_losses", "token_cross_entropy"})

    def build(self, backend: Backend, context: Any) -> Any:
        """The trainer for ``backend`` (transformers only); ``context`` is its trainer set-up."""
        if backend.name != "transformers":
            raise NotImplementedError(f"the distill task has no trainer for backend {backend.name!r}")
        from soup_core.default_plugins.transformers import datasets_for
        from soup_plugin_distill.trainer import DistillTrainer

        train_dataset, eval_dataset = datasets_for(self, context)
        return DistillTrainer.from_setup(context, train_dataset, eval_dataset)
