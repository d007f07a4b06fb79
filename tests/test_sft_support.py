"""Every field in the (transformers, sft) support row really changes the run (docs/architecture.md).

One case per honoured field: it sets a non-default value and checks its effect on the live trainer's
arguments, the model, the data the trainer sees, or the run's behaviour.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def _lora_modules(model):
    return {name.rsplit(".", 1)[-1]: module for name, module in model.named_modules() if hasattr(module, "lora_A")}


def _first_batch(run):
    return next(iter(run.trainer.get_train_dataloader()))


def case_data_train(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(7))
    assert run.ctx.training.n_rows == 7 and len(run.trainer.train_dataset) == 7


def case_data_format(sft_run, rows, tmp_path):
    both = [{**r, "text": f"plain {i}"} for i, r in enumerate(rows(6))]
    auto, _ = sft_run(both)
    forced, _ = sft_run(both, data={"format": "text"})
    assert auto.ctx.training.format == "chat" and forced.ctx.training.format == "text"
    assert all(ex["labels"] == ex["input_ids"] for ex in forced.trainer.train_dataset)
    assert any(ex["labels"] != ex["input_ids"] for ex in auto.trainer.train_dataset)


def case_data_val_split(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(10), data={"val_split": 0.2})
    assert len(run.trainer.eval_dataset) == 2 and len(run.trainer.train_dataset) == 8
    assert run.trainer.args.eval_strategy == "epoch"


def case_data_seed(sft_run, rows, tmp_path):
    from soup_core.data import micro_batches

    run, _ = sft_run(rows(10), data={"seed": 5})
    order = [batch["row_index"].tolist() for batch in run.trainer.get_train_dataloader()]
    assert order == micro_batches(10, batch_size=4, epoch=0, seed=5)
    assert order != micro_batches(10, batch_size=4, epoch=0, seed=42)


def case_data_max_length(sft_run, rows, tmp_path):
    # 32 cuts every row (34-44 tokens) but leaves each some answer tokens: a limit that leaves none is refused
    run, _ = sft_run(rows(6), data={"max_length": 32})
    lengths = [len(ex["input_ids"]) for ex in run.trainer.train_dataset]
    assert max(lengths) == 32


def case_data_train_on_responses_only(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(6), data={"train_on_responses_only": False})
    assert all(ex["labels"] == ex["input_ids"] for ex in run.trainer.train_dataset)


def case_data_on_bad_row(sft_run, rows, tmp_path):
    bad = rows(6) + [{"messages": "not a list"}]
    run, _ = sft_run(bad, data={"on_bad_row": "skip"})
    assert run.ctx.training.n_rows == 6 and len(run.ctx.training.skipped) == 1


def case_data_packing(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), data={"packing": True})
    batch = _first_batch(run)
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    assert int((batch["position_ids"][0] == 0).sum()) == 4 and batch["token_slot"].max().item() == 3


def case_data_chat_template(sft_run, rows, tmp_path):
    from soup_core.default_plugins.chat_templates import TEMPLATES

    run, _ = sft_run(rows(6), data={"chat_template": "chatml"})
    assert run.setup.tokenizer.chat_template == TEMPLATES["chatml"]
    text = run.setup.tokenizer.decode(run.trainer.train_dataset[0]["input_ids"])
    assert "<|im_start|>assistant" in text and "<|assistant|>" not in text


def case_training_epochs(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"max_steps": None, "epochs": 2})
    assert run.trainer.args.num_train_epochs == 2 and run.trainer.args.max_steps == -1
    assert run.run()["steps"] == 4  # 8 rows, batch 4: 2 steps per epoch


def case_training_max_steps(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"max_steps": 3})
    assert run.trainer.args.max_steps == 3 and run.run()["steps"] == 3


def case_training_learning_rate(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"learning_rate": 1e-3, "scheduler": "constant"})
    assert run.trainer.args.learning_rate == 1e-3
    run.run()
    assert run.trainer.soup_last_metrics["learning_rate"] == 1e-3


def case_training_batch_size(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"batch_size": 2})
    assert run.trainer.args.per_device_train_batch_size == 2 and len(_first_batch(run)["row_index"]) == 2


def case_training_gradient_accumulation_steps(sft_run, rows, tmp_path):
    run, recorder = sft_run(rows(12), training={"gradient_accumulation_steps": 3, "max_steps": 1})
    assert run.trainer.args.gradient_accumulation_steps == 3
    run.run()
    assert [(e.step, e.micro) for e in recorder.micro] == [(1, 0), (1, 1), (1, 2)]


def case_training_scheduler(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"scheduler": "cosine"})
    assert run.trainer.args.lr_scheduler_type == "cosine"


def case_training_warmup_ratio(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"warmup_ratio": 0.1})
    assert run.trainer.args.warmup_steps == 0.1 and run.trainer.args.get_warmup_steps(100) == 10


def case_training_weight_decay(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"weight_decay": 0.1})
    assert run.trainer.args.weight_decay == 0.1


def case_training_max_grad_norm(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"max_grad_norm": 0.5})
    assert run.trainer.args.max_grad_norm == 0.5


def case_training_seed(sft_run, rows, tmp_path):
    import torch

    runs = {seed: sft_run(rows(8), training={"seed": seed})[0] for seed in (3, 42)}
    assert runs[3].trainer.args.seed == 3
    a = _lora_modules(runs[3].trainer.model)["q_proj"].lora_A["default"].weight
    b = _lora_modules(runs[42].trainer.model)["q_proj"].lora_A["default"].weight
    assert not torch.equal(a, b)


def case_training_dtype(sft_run, rows, tmp_path):
    auto, _ = sft_run(rows(8))
    run, _ = sft_run(rows(8), training={"dtype": "bfloat16"})
    assert run.trainer.args.bf16 is True and run.trainer.args.fp16 is False
    assert auto.trainer.args.bf16 is False  # auto is fp32 on a CPU


def _four_bit(sft_run, rows, **extra):
    import bitsandbytes as bnb

    run, _ = sft_run(rows(8), training={"quantization": "4bit", **extra})
    return [m for m in run.trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def case_training_quantization(sft_run, rows, tmp_path):
    assert _four_bit(sft_run, rows)


def case_training_bnb_4bit_use_double_quant(sft_run, rows, tmp_path):
    assert all(m.weight.quant_state.nested for m in _four_bit(sft_run, rows))
    assert not any(m.weight.quant_state.nested for m in _four_bit(sft_run, rows, bnb_4bit_use_double_quant=False))


def case_training_gradient_checkpointing(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"gradient_checkpointing": True, "max_steps": 1})
    assert run.trainer.args.gradient_checkpointing is True
    run.run()
    base = run.trainer.model.get_base_model()
    assert getattr(base, "is_activation_checkpointing", None) or base.is_gradient_checkpointing


def case_training_lora_r(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"lora": {"r": 4}})
    assert _lora_modules(run.trainer.model)["q_proj"].lora_A["default"].weight.shape[0] == 4


def case_training_lora_alpha(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"lora": {"alpha": 32}})
    assert _lora_modules(run.trainer.model)["q_proj"].scaling["default"] == 32 / 8


def case_training_lora_dropout(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"lora": {"dropout": 0.2}})
    assert _lora_modules(run.trainer.model)["q_proj"].lora_dropout["default"].p == 0.2


def case_training_lora_target_modules(sft_run, rows, tmp_path):
    auto, _ = sft_run(rows(8))
    run, _ = sft_run(rows(8), training={"lora": {"target_modules": ["q_proj", "v_proj"]}})
    assert set(_lora_modules(run.trainer.model)) == {"q_proj", "v_proj"}
    assert set(_lora_modules(auto.trainer.model)) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }


def case_training_save_steps(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"save_steps": 1, "max_steps": 2}, output=tmp_path / "saves")
    assert run.trainer.args.save_strategy == "steps" and run.trainer.args.save_steps == 1
    run.run()
    assert sorted(p.name for p in (tmp_path / "saves").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


def case_training_save_total_limit(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"save_steps": 1, "max_steps": 3, "save_total_limit": 2},
                     output=tmp_path / "kept")
    run.run()
    assert sorted(p.name for p in (tmp_path / "kept").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


def case_training_eval_steps(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(10), data={"val_split": 0.2}, training={"eval_steps": 1})
    assert run.trainer.args.eval_strategy == "steps" and run.trainer.args.eval_steps == 1


def case_training_logging_steps(sft_run, rows, tmp_path):
    run, _ = sft_run(rows(8), training={"logging_steps": 3})
    assert run.trainer.args.logging_steps == 3 and run.setup.progress.logging_steps == 3


def case_training_resume_from(sft_run, rows, tmp_path):
    first, _ = sft_run(rows(8), training={"save_steps": 1, "max_steps": 1}, output=tmp_path / "first")
    first.run()
    checkpoint = str(tmp_path / "first" / "checkpoint-1")
    run, recorder = sft_run(rows(8), training={"resume_from": checkpoint}, resume_from=checkpoint)
    run.run()
    assert recorder.starts[0].resumed_from_step == 1 and [e.step for e in recorder.micro] == [2]


def case_training_report_to(sft_run, rows, tmp_path):
    from soup_core import ProbeResult
    from soup_core.default_plugins.transformers import BackendError
    from soup_core.default_plugins.transformers import backend as backend_module

    with pytest.raises(BackendError, match="pip install tensorboard"):
        sft_run(rows(8), training={"report_to": ["tensorboard"]})
    run, _ = sft_run(rows(8))
    config = run.ctx.config.model_copy(deep=True)
    config.training.report_to = ["tensorboard"]
    real = backend_module.module_findable
    backend_module.module_findable = lambda name: ProbeResult(True)  # as if tensorboard were installed
    try:
        args = backend_module.build_training_args(config, tmp_path / "x", has_eval=False)
    finally:
        backend_module.module_findable = real
    assert args.report_to == ["tensorboard"] and run.trainer.args.report_to == []


CASES = {
    name[len("case_") :].replace("_", ".", 1).replace("training.lora_", "training.lora."): fn
    for name, fn in dict(globals()).items()
    if name.startswith("case_")
}


def test_every_honoured_field_has_a_case():
    from soup_core.default_plugins.transformers import HONOURED_FIELDS

    assert set(CASES) == set(HONOURED_FIELDS)


@pytest.mark.parametrize("field", sorted(CASES))
def test_field_changes_the_run(field, sft_run, make_chat_rows, tmp_path):
    CASES[field](sft_run, make_chat_rows, tmp_path)


def test_support_row_and_hooks_are_registered():
    from soup_core.default_plugins.transformers import HONOURED_FIELDS, TransformersBackend, plugin

    assert plugin.SOUP_HOOK_API == (1, 1)
    assert plugin.soup_register_backends() == [TransformersBackend]
    from soup_core.default_plugins.transformers.sharding import SHARDING_FIELDS

    row, weights, sharding = plugin.soup_register_support()
    assert (row.backend, row.task, row.fields) == ("transformers", "sft", HONOURED_FIELDS)
    # a file's weight only where the sampler draws by it (tests/test_data_files.py), not in every HONOURED_FIELDS user
    assert (weights.backend, weights.task, weights.fields) == ("transformers", "sft", {"data.train.weight"})
    # sharding goes to every task declaring "shardable"; the rest refuse it with a reason per field
    assert (sharding.backend, sharding.task, sharding.capability) == ("transformers", "*", "shardable")
    assert sharding.fields == SHARDING_FIELDS and set(sharding.reasons) == set(SHARDING_FIELDS)
    assert plugin.soup_load_model(config=None, backend="mlx", task=None) is None
    assert json.dumps(sorted(HONOURED_FIELDS))  # plain strings
