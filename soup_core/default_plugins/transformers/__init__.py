"""The default plugin ``core.transformers`` (registered by :mod:`.plugin`): the transformers backend, the
trainer base a task plugin extends, and a tiny local model for tests.

What a plugin imports from here (docs/plugins.md, "The trainer seam"):

- the trainer seam: :class:`SoupTrainerMixin` (``from_setup``, ``soup_token_loss``, ``soup_row_losses``),
  :class:`SoupSFTTrainer`, :class:`TrainerSetup`, :class:`RowCollator`, :func:`datasets_for`, :func:`row_sums`;
- the backend: :data:`HONOURED_FIELDS` (the support row of ``(transformers, sft)``), :class:`BackendError`,
  :func:`load_model_and_tokenizer`, :func:`apply_lora`, :func:`install_lean_lora`, :func:`resolve_dtype`,
  :func:`resolve_target_modules`, :func:`merge_adapter`, :class:`TransformersBackend`;
- a tiny local model: :func:`tiny_model_dir`, :func:`build_tiny_model`, :func:`build_tiny_tokenizer`, and one
  pretrained on synthetic chat rows (:func:`tiny_pretrained_dir`, :func:`synthetic_conversations`);
- :func:`base_problem`: what a dry run can check of a base without loading its weights, and
  :func:`load_tokenizer`: a base's tokenizer, as a dry run loads it;
- GGUF bases: :func:`resolve_base` (the folder to load for a base: a GGUF file's dequantised folder, built on
  first use), :func:`gguf_file`, :func:`inspect_base` (its header, or why it cannot be loaded),
  :func:`kept_folder`, :func:`source_record` and :class:`GGUFError`;
- key-fact questions (``soup quickstart``'s score, ``soup eval --facts``): :func:`read_facts`, :class:`Fact`,
  :class:`FactsError`, :func:`greedy_answers`, :func:`score_facts`, :func:`facts_share`, :data:`FACTS_BATCH_SIZE`.

Importing this package imports nothing: each name loads its module on first use (the trainer's brings torch,
transformers and trl), so a plugin module that ``soup --help`` imports may name them inside functions.
"""

from __future__ import annotations

import importlib
from typing import Any

from soup_core.default_plugins.transformers.noise import silence_third_party_noise

# every module of this package (the backend, the trainer, the loaders, the base checks) imports transformers,
# peft, trl or bitsandbytes, and each runs this package first: silenced here, silenced for all of them
silence_third_party_noise()

# name -> submodule
_EXPORTS = {
    **dict.fromkeys(("HONOURED_FIELDS", "PreparedRun", "TransformersBackend"), "backend"),
    **dict.fromkeys(("BackendError", "apply_lora", "install_lean_lora", "load_model_and_tokenizer", "merge_adapter",
                     "resolve_dtype", "resolve_target_modules"), "loading"),
    **dict.fromkeys(("RowCollator", "SoupSFTTrainer", "SoupTrainerMixin", "TrainerSetup", "datasets_for",
                     "row_sums"), "trainer"),
    **dict.fromkeys(("build_tiny_model", "build_tiny_tokenizer", "tiny_model_dir"), "tiny"),
    **dict.fromkeys(("synthetic_conversations", "tiny_pretrained_dir"), "tiny_pretrained"),
    **dict.fromkeys(("base_problem", "load_tokenizer"), "checks"),
    **dict.fromkeys(("GGUFError", "gguf_file", "inspect_base", "kept_folder", "resolve_base", "source_record"),
                    "gguf"),
    **dict.fromkeys(("FACTS_BATCH_SIZE", "Fact", "FactsError", "facts_share", "greedy_answers", "read_facts",
                     "score_facts"), "facts"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
