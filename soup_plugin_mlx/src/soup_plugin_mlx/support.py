"""The (mlx, sft) support row: every config path the MLX backend really honours.

A path missing here is refused at config time by the core when it is set to a non-default value
(docs/architecture.md). Each entry is exercised by a test that sets a non-default value and shows its
effect.
Left out on purpose, so they are refused rather than ignored:

- ``data.packing``: mlx-lm's attention has no per-row boundaries inside one packed sequence;
- ``training.quantization`` / ``training.bnb_4bit_use_double_quant``: bitsandbytes NF4/int8 do not exist
  in MLX (its own 4-bit format is a different recipe);
- ``training.report_to``: tensorboard / wandb / mlflow reporting is the transformers Trainer's;
- ``data.chat_template``: chats are rendered with the template mlx-lm's tokenizer carries.
"""

from __future__ import annotations

#: Config paths the (mlx, sft) pair honours.
HONOURED_FIELDS: frozenset[str] = frozenset(
    {
        "data.train",
        "data.format",
        "data.val_split",
        "data.seed",
        "data.on_bad_row",
        "data.max_length",
        "data.train_on_responses_only",
        "training.epochs",
        "training.max_steps",
        "training.learning_rate",
        "training.batch_size",
        "training.gradient_accumulation_steps",
        "training.scheduler",
        "training.warmup_ratio",
        "training.weight_decay",
        "training.max_grad_norm",
        "training.seed",
        "training.dtype",
        "training.gradient_checkpointing",
        "training.lora.r",
        "training.lora.alpha",
        "training.lora.dropout",
        "training.lora.target_modules",
        "training.save_steps",
        "training.eval_steps",
        "training.logging_steps",
        "training.resume_from",
    }
)

#: Why the fields the transformers backend honours are refused here (shown by the README and tests).
REFUSED_REASONS: dict[str, str] = {
    "data.packing": "mlx-lm's attention cannot keep packed rows apart",
    "training.quantization": "bitsandbytes 4/8-bit quantisation does not exist in MLX",
    "training.bnb_4bit_use_double_quant": "bitsandbytes 4/8-bit quantisation does not exist in MLX",
    "training.report_to": "tensorboard/wandb/mlflow reporting belongs to the transformers Trainer",
    "training.save_total_limit": "the mlx trainer keeps every checkpoint it writes (it deletes none)",
    "data.chat_template": "the mlx backend renders chats with the model's own template (mlx-lm's tokenizer)",
}
