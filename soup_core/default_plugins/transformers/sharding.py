"""``training.sharding``: FSDP2 or DeepSpeed ZeRO through the Trainer's own integrations (accelerate), no
sharding code of Soup's own. The model is wrapped by decoder layer (the model's ``_no_split_modules``);
``training.gradient_checkpointing`` becomes FSDP's activation checkpointing (the Trainer's would add an
all-gather per layer in the backward pass); ``training.cpu_offload`` is FSDP's / ZeRO's CPU offload.

ZeRO needs a working ``deepspeed`` and an accelerator it supports: a deep check (it imports deepspeed)
refuses the run before data or a model is loaded when either is missing, saying which.
"""

from __future__ import annotations

import os
from typing import Any

#: the support-table fields of this module: honoured with every task whose class declares the capability
#: ``shardable`` (its trainer was shown to train sharded as it trains unsharded); refused, with
#: :data:`UNSHARDED`, with the others
SHARDING_FIELDS: frozenset[str] = frozenset({"training.sharding", "training.cpu_offload"})
UNSHARDED = ("this task has not been shown to train sharded (its class does not declare the 'shardable' "
             "capability); train it with DDP (soup train --nproc N, training.sharding: none) or on one process")


def sharding_problem(config: Any) -> str | None:
    """Why this config's sharding cannot run here (None when it can): for the pre-flight, so ``--dry-run``
    and the launcher refuse before any process starts."""
    t = config.training
    mode = str(getattr(t, "sharding", "none"))
    if getattr(t, "cpu_offload", False) and mode in ("none", "zero2"):
        return (f"training.cpu_offload needs training.sharding fsdp or zero3 (it is {mode}): offload moves the "
                "shards to the CPU; set training.sharding, or remove training.cpu_offload")
    if mode != "none" and str(getattr(t, "quantization", "none")) != "none":
        return (f"training.sharding {mode} with training.quantization {t.quantization}: sharding a bitsandbytes "
                "model is not supported here; shard the unquantised model (LoRA on a sharded bf16 base), or "
                "train the quantised one with training.sharding: none")
    problem = _deepspeed_problem(mode) if mode in ("zero2", "zero3") else None
    if problem is None and getattr(t, "cpu_offload", False) and not _accelerator():
        problem = ("training.cpu_offload moves the shards from the GPUs to the CPU, and this run has no GPU: it "
                   "trains on the CPU already; remove training.cpu_offload")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if problem is None and mode != "none" and world < 2:
        problem = (f"training.sharding {mode} shards the model over several processes, and this run has one; "
                   "launch it with soup train --nproc N (and --nnodes for several machines), or set "
                   "training.sharding: none")
    return problem


def _deepspeed_problem(mode: str) -> str | None:
    """A deep probe: imports deepspeed and asks torch for an accelerator DeepSpeed's ZeRO runs on."""
    import importlib

    try:
        deepspeed = importlib.import_module("deepspeed")
    except Exception as exc:  # noqa: BLE001 - a broken install is as unusable as a missing one
        return (f"training.sharding {mode} trains through DeepSpeed, which does not import here "
                f"({type(exc).__name__}: {exc}); pip install deepspeed on a machine with a CUDA GPU, or use "
                "training.sharding fsdp")
    import torch

    if not torch.cuda.is_available():
        return (f"training.sharding {mode}: deepspeed {getattr(deepspeed, '__version__', '?')} is installed, but "
                "no CUDA GPU is visible, and ZeRO shards onto GPUs; use training.sharding fsdp (it runs on the "
                "CPU too), or run on a machine with GPUs")
    return None


def _accelerator() -> bool:
    import torch

    return torch.cuda.is_available()


def decoder_layers(model: Any) -> list[str]:
    """The class names FSDP wraps one by one: the model's decoder layers (transformers' ``_no_split_modules``,
    which PEFT's wrapper does not carry itself)."""
    names = next((list(m._no_split_modules) for m in model.modules() if getattr(m, "_no_split_modules", None)),
                 [])
    if not names:
        from soup_core.default_plugins.transformers.loading import BackendError

        raise BackendError(f"training.sharding fsdp: {type(model).__name__} does not name its decoder layers "
                           "(_no_split_modules), so FSDP cannot wrap it layer by layer; use training.sharding none")
    return names


def training_kwargs(config: Any, model: Any) -> dict[str, Any]:
    """The ``TrainingArguments`` keywords that shard this run ({} for ``sharding: none``)."""
    t = config.training
    mode = str(getattr(t, "sharding", "none"))
    if mode == "none":
        return {}
    gc = bool(t.gradient_checkpointing)
    if mode == "fsdp":
        # full_shard: reshard_after_forward; one unit per decoder layer (transformer-based wrapping)
        fsdp_config = {"version": 2, "transformer_layer_cls_to_wrap": decoder_layers(model),
                       "activation_checkpointing": gc, "state_dict_type": "FULL_STATE_DICT",
                       "reshard_after_forward": True, "cpu_offload": bool(t.cpu_offload),
                       "cpu_ram_efficient_loading": False}
        # FSDP checkpoints activations itself; the Trainer's own checkpointing on top is refused by accelerate
        return {"fsdp": True, "fsdp_config": fsdp_config, **_no_trainer_checkpointing()}
    stage = 2 if mode == "zero2" else 3
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if t.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:  # the saved model is whole, in the format a one-process run writes
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    ds = {"zero_optimization": zero, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
          "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
    return {"deepspeed": ds}


def _no_trainer_checkpointing() -> dict[str, Any]:
    from trl import SFTConfig

    out: dict[str, Any] = {"gradient_checkpointing": False, "gradient_checkpointing_kwargs": None}
    if "activation_checkpointing" in getattr(SFTConfig, "__dataclass_fields__", {}):
        out.update(activation_checkpointing=False, activation_checkpointing_kwargs=None)
    return out


def enable_on_cpu(trainer: Any) -> None:
    """Put accelerate's FSDP plugin in place on a CPU run. accelerate enables FSDP only on accelerators: on
    the CPU (its MULTI_CPU type) it drops the plugin and wraps the model in DDP, so ``sharding: fsdp`` would
    silently train unsharded. torch's ``fully_shard`` runs over gloo, so the same plugin is set here and
    accelerate's own FSDP2 preparation shards the model."""
    if getattr(trainer.args, "fsdp_plugin_args", None) is None:
        return
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if state.distributed_type != DistributedType.FSDP:  # (a re-created accelerator starts from MULTI_CPU again)
        if state.distributed_type != DistributedType.MULTI_CPU:
            from soup_core.default_plugins.transformers.loading import BackendError

            raise BackendError(f"training.sharding fsdp: accelerate did not enable FSDP for this run "
                               f"({state.distributed_type}); it needs several processes (soup train --nproc N)")
        if getattr(state, "fsdp_plugin", None) is None:
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
        state.distributed_type = DistributedType.FSDP
        trainer.is_fsdp_enabled = True
    from accelerate.state import PartialState

    # every AcceleratorState() copies PartialState's type over its own: without this, saving and resuming
    # would find MULTI_CPU again and take DDP's paths on FSDP's shards (a rank-0-only load that never ends)
    PartialState().distributed_type = DistributedType.FSDP
    if trainer.accelerator.device.type == "cpu":
        trainer.accelerator.get_state_dict = _whole_state_dict


def _whole_state_dict(model: Any, unwrap: bool = True) -> dict[str, Any]:
    """The full state dict on global rank 0 ({} elsewhere), as accelerate builds it for FSDP2, asked of torch
    directly: accelerate reads its distributed type again when saving and finds MULTI_CPU there."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
