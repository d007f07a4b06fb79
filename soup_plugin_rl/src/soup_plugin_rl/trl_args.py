"""The installed trl config object for a task, built from the core's training arguments.

The transformers backend builds one ``trl.SFTConfig`` from the soup config (every optimisation, logging,
checkpoint and numerics setting). A task here copies those settings into its own trl config class
(DPOConfig, GRPOConfig, ...), passing only the keywords that class accepts (asked of its signature),
then the task's own keywords — which it requires: a config class that does not take one is a
:class:`CapabilityError`, never a silently dropped setting.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from soup_core import probes
from soup_plugin_rl.errors import CapabilityError

#: TrainingArguments settings the backend decides from the soup config, copied to every task's config.
SHARED_ARGS = (
    "output_dir",
    "run_name",
    "num_train_epochs",
    "max_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "seed",
    "bf16",
    "fp16",
    "use_cpu",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "activation_checkpointing",
    "activation_checkpointing_kwargs",
    "optim",
    "logging_strategy",
    "logging_steps",
    "report_to",
    "disable_tqdm",
    "dataloader_num_workers",
    "eval_strategy",
    "eval_steps",
    "save_strategy",
    "save_steps",
)


def _plain(value: Any) -> Any:
    # TrainingArguments turns strings into enums after construction; give them back as strings.
    return value.value if isinstance(value, enum.Enum) else value


def shared_settings(base_args: Any) -> dict[str, Any]:
    """The backend's settings (from its trl.SFTConfig) that every task keeps."""
    return {name: _plain(getattr(base_args, name)) for name in SHARED_ARGS if hasattr(base_args, name)}


def build_config(
    config_cls: Any,
    base_args: Any,
    *,
    required: Mapping[str, Any],
    optional: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """``config_cls(**settings)``: the backend's settings and ``optional`` where the class accepts them,
    ``overrides`` (replacing shared settings, e.g. the batch size) likewise, and ``required``, which it
    must accept."""
    missing = [k for k in required if not probes.accepts(config_cls, k)]
    if missing:
        raise CapabilityError(
            f"{config_cls.__name__} of the installed trl does not accept {', '.join(missing)}"
        )
    wanted = {**shared_settings(base_args), **(optional or {}), **(overrides or {})}
    kwargs = probes.supported_kwargs(config_cls, wanted)
    kwargs.update(required)
    return config_cls(**kwargs)
