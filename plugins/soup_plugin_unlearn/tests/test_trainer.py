"""The unlearn trainer inside the core's machinery, run in-process through ``soup train`` on the tiny model:
row order and per-row forget losses in the micro-batch events, LoRA target_modules, the tracker and the
evaluation record, ``unlearn_alpha: 0`` (the retain term is absent), one copy of the weights during an NPO
step (with a deep-copied reference as the control), and resume.
"""

from __future__ import annotations

import copy
import gc
import json
from pathlib import Path
from typing import Any

import pytest

from soup_core.testing import TrainingFailed

pytestmark = pytest.mark.slow


def _adapter(run: Any) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(run.output_dir / "adapter_model.safetensors"))


def _eval_record(run: Any) -> dict[str, Any]:
    return json.loads((run.output_dir / "unlearn_eval.json").read_text(encoding="utf-8"))


def _per_row_nll(base: Path, path: Path, max_length: int) -> tuple[list[float], list[int]]:
    """Each row's mean next-token loss over its supervised tokens, and their count, by transformers' own
    loss on one row at a time (independent of the plugin's code)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.sft import encode_rows

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    losses, counts = [], []
    with torch.no_grad():
        for example in encode_rows(rows, tok, max_length=max_length):
            ids = torch.tensor([example["input_ids"]])
            labels = torch.tensor([example["labels"]])
            losses.append(float(model(input_ids=ids, labels=labels).loss))
            counts.append(int((labels[0, 1:] != -100).sum()))
    return losses, counts


def test_events_carry_the_forget_rows_in_the_cores_order_with_their_losses(
    soup_train, unlearn_config, tiny_model, demo_data
):
    import soup_core

    config = unlearn_config(
        "events",
        training={
            "batch_size": 3,
            "gradient_accumulation_steps": 2,
            "max_steps": 2,
            "logging_steps": 1,
            "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
        },
    )
    rec = run = soup_train(config)

    forget = soup_core.build_training_list(
        {"forget": str(demo_data["forget"])},
        key="forget",
        formats=dict(soup_core.load_plugins().data_formats.items()),
    )
    start = rec.starts[0]
    assert (start.task, start.n_rows, start.fingerprint) == ("unlearn", 8, forget.fingerprint)

    # 8 rows in micro-batches of 3, two per step: the epoch's third micro-batch makes step 2 alone
    batches = soup_core.micro_batches(8, batch_size=3, epoch=0, seed=42)
    assert [(e.step, e.micro) for e in rec.micro] == [(1, 0), (1, 1), (2, 0)]
    assert [list(e.rows) for e in rec.micro] == batches

    # step 1 trains the starting model (a LoRA adapter starts as the identity): its per-row losses are the
    # base model's, measured independently
    want, counts = _per_row_nll(tiny_model, demo_data["forget"], 48)
    for event in rec.micro[:2]:
        assert list(event.row_tokens) == [counts[r] for r in event.rows]
        assert list(event.row_loss) == pytest.approx([want[r] for r in event.rows], rel=1e-4)
    assert [s.step for s in rec.steps] == [1, 2] and [e.status for e in rec.ends] == ["completed"]

    adapter_config = json.loads((run.output_dir / "adapter_config.json").read_text())
    assert set(adapter_config["target_modules"]) == {"q_proj", "v_proj"}
    assert {k.split(".")[-3] for k in _adapter(run)} == {"q_proj", "v_proj"}

    record = _eval_record(run)
    assert record["params"] == {"method": "npo", "alpha": 2.0, "beta": 0.1}
    assert record["rows"] == {"forget": 8, "retain": 16} and record["step"] == 2
    # the starting model's forget loss: the token-weighted mean of the independent per-row losses
    weighted = sum(w * c for w, c in zip(want, counts, strict=True)) / sum(counts)
    assert record["start"]["forget_loss"] == pytest.approx(weighted, rel=1e-4)
    assert record["end"]["forget_loss"] > record["start"]["forget_loss"]

    tracked = soup_core.Tracker().get_run("latest")
    metrics = dict(soup_core.Tracker().metrics(tracked.run_id))
    assert {"forget_loss", "retain_loss", "forget_loss_start", "retain_loss_start"} <= set(metrics[0])
    assert {"loss", "forget_term", "retain_term", "grad_norm"} <= set(metrics[1])
    assert metrics[2]["forget_loss"] == pytest.approx(record["end"]["forget_loss"])


def test_alpha_zero_trains_on_the_forget_loss_alone(
    soup_train, unlearn_config, tmp_path, demo_data, torch_one_thread
):
    torch = torch_one_thread
    # another retain set: different rows, same format
    other = tmp_path / "other-retain.jsonl"
    rows = [json.loads(line) for line in demo_data["retain"].read_text().splitlines()]
    other.write_text(
        "".join(json.dumps({"prompt": r["completion"], "completion": r["prompt"]}) + "\n" for r in rows)
    )

    def adapter(name: str, alpha: float, retain: Path) -> dict[str, Any]:
        run = soup_train(
            unlearn_config(
                name, data={"retain": str(retain)}, training={"unlearn_alpha": alpha, "max_steps": 3}
            )
        )
        return _adapter(run)

    def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    zero_a = adapter("zero-a", 0.0, demo_data["retain"])
    zero_b = adapter("zero-b", 0.0, other)
    assert same(zero_a, zero_b)  # the retain rows do not touch the result: the retain term is absent
    one_a = adapter("one-a", 1.0, demo_data["retain"])
    one_b = adapter("one-b", 1.0, other)
    assert not same(one_a, one_b)  # control: with α > 0 the same comparison sees the retain rows
    assert not same(zero_a, one_a)  # and a non-zero α changes the result (0 is not read as 1)


def _parameter_storages() -> dict[int, int]:
    """data pointer -> bytes of every distinct storage behind a live ``nn.Parameter``."""
    import torch

    gc.collect()
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Parameter):
            storage = obj.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _tensor_bytes(path: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for t in load_file(str(path)).values())


def _copyref_task() -> tuple[type, Any]:
    """The control: a task whose trainer keeps a deep copy of the model as NPO's reference, as the
    upstream tool did."""
    import torch

    from soup_core import Support
    from soup_plugin_unlearn.fields import HONOURED
    from soup_plugin_unlearn.losses import sequence_logps
    from soup_plugin_unlearn.task import UnlearnTask
    from soup_plugin_unlearn.trainer import UnlearnTrainer

    class CopyReferenceTrainer(UnlearnTrainer):
        def reference_logps(self, model, inputs):
            if not hasattr(self, "reference_copy"):
                self.reference_copy = copy.deepcopy(self.accelerator.unwrap_model(model).get_base_model())
            with torch.no_grad():
                logits = self.reference_copy(
                    input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
                ).logits
            return sequence_logps(logits, inputs["labels"])[0]

    class CopyReferenceTask(UnlearnTask):
        name = "unlearn_copyref"

        def trainer_class(self) -> type:
            return CopyReferenceTrainer

    return CopyReferenceTask, Support(backend="transformers", task="unlearn_copyref", fields=HONOURED)


def test_an_npo_step_holds_one_model_plus_the_adapter(
    soup_train, unlearn_config, tiny_model, micro_batch_probes, plugin_with
):
    one_model = _tensor_bytes(tiny_model / "model.safetensors")

    def measured(name: str, **kwargs: Any) -> tuple[int, int]:
        before = _parameter_storages()
        seen: list[int] = []

        def probe(event: Any) -> None:  # runs inside the step: after the reference and forget passes
            if not seen:
                now = _parameter_storages()
                seen.append(sum(size for ptr, size in now.items() if ptr not in before))

        micro_batch_probes.append(probe)
        run = soup_train(unlearn_config(name, training={"max_steps": 1}), **kwargs)
        micro_batch_probes.clear()
        return seen[0], _tensor_bytes(run.output_dir / "adapter_model.safetensors")

    live, adapter = measured("one-copy")
    assert adapter > 0 and live == one_model + adapter

    task, support = _copyref_task()
    control_live, control_adapter = measured(
        "copy", overrides={"task": "unlearn_copyref"}, plugin=plugin_with(tasks=[task], support=[support])
    )
    assert control_live != one_model + control_adapter  # the same check fails with a second copy
    assert control_live >= 2 * one_model


def _restarting_task() -> tuple[type, Any]:
    """The control for resume: a trainer that numbers micro-batches from 0 in every process (so a resumed
    run would draw the retain batches of the run's start again)."""
    from soup_core import Support
    from soup_plugin_unlearn.fields import HONOURED
    from soup_plugin_unlearn.task import UnlearnTask
    from soup_plugin_unlearn.trainer import UnlearnTrainer

    class RestartingTrainer(UnlearnTrainer):
        def _micro_number(self) -> int:
            self.count = getattr(self, "count", -1) + 1
            return self.count

    class RestartingTask(UnlearnTask):
        name = "unlearn_restart"

        def trainer_class(self) -> type:
            return RestartingTrainer

    return RestartingTask, Support(backend="transformers", task="unlearn_restart", fields=HONOURED)


def test_resume_reproduces_the_uninterrupted_run(soup_train, unlearn_config, plugin_with, torch_one_thread):
    torch = torch_one_thread
    training = {
        "max_steps": 4,
        "save_steps": 2,
        "batch_size": 4,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.1},
    }
    full = soup_train(unlearn_config("full", training=training))
    checkpoint = full.output_dir / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").is_file()

    resumed = soup_train(unlearn_config("resumed", training={**training, "resume_from": str(checkpoint)}))
    assert resumed.start.resumed_from_step == 2
    assert [e.step for e in resumed.micro] == [3, 4]
    assert [e.rows for e in resumed.micro] == [e.rows for e in full.micro[2:]]
    a, b = _adapter(full), _adapter(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)

    task, support = _restarting_task()
    wrong = soup_train(
        unlearn_config("restart", training={**training, "resume_from": str(checkpoint)}),
        overrides={"task": "unlearn_restart"},
        plugin=plugin_with(tasks=[task], support=[support]),
    )
    c = _adapter(wrong)
    assert not all(torch.equal(a[k], c[k]) for k in a)  # control: other retain batches, another result


def test_rmu_steers_the_middle_layer_by_default_and_refuses_a_missing_layer(soup_train, unlearn_config, tiny_model):
    from safetensors.torch import load_file

    training = {"unlearn_method": "rmu", "max_steps": 2, "gradient_checkpointing": True}
    config = unlearn_config("rmu", training=training, data={"val_split": 0.25})
    del config["training"]["lora"]  # the paper's recipe adds no adapter
    run = soup_train(config)
    record = _eval_record(run)
    params = dict(record["params"])
    norm = params.pop("rmu_start_norm")
    assert params == {
        "method": "rmu", "alpha": 100.0, "rmu_layer": 1, "rmu_coeff": pytest.approx(5 * norm, rel=1e-6),
        "rmu_params": "mlp", "rmu_tokens": "all",
    }
    # data.val_split holds rows of both sets out; they are measured, not trained on
    assert record["rows"] == {"forget": 6, "retain": 12, "forget_heldout": 2, "retain_heldout": 4}
    assert {"forget_heldout_loss", "retain_heldout_loss"} <= set(record["end"])
    assert [len(e.row_loss) for e in run.micro] == [4, 2]
    assert all(r < 6 for e in run.micro for r in e.rows)
    # only the MLP parameters of layers l-2..l (here 0 and 1) trained; every other weight is the base's
    assert not (run.output_dir / "adapter_config.json").exists()
    before = load_file(str(tiny_model / "model.safetensors"))
    after = load_file(str(run.output_dir / "model.safetensors"))
    changed = {k for k in before if not torch_equal(before[k], after[k])}
    mlp = {k for k in before if ".mlp." in k and k.split(".layers.")[1].split(".")[0] in ("0", "1")}
    assert mlp and changed == mlp, sorted(changed ^ mlp)
    # the run's starting numbers are the base's (the starting MLP weights swapped back in)
    assert record["start"]["forget_loss"] != pytest.approx(record["end"]["forget_loss"], rel=1e-3)

    with pytest.raises(TrainingFailed) as bad:
        soup_train(unlearn_config("rmu-bad", training={"unlearn_method": "rmu", "unlearn_rmu_params": "lora",
                                                       "unlearn_rmu_layer": 5}))
    assert "training.unlearn_rmu_layer: 5 is not a decoder layer of this model (it has 2: 0 to 1)" in bad.value.message


def _layer_norm(model_dir: Any, rows: list[dict[str, Any]], layer: int) -> float:
    """Plain PyTorch: the mean norm of decoder layer ``layer``'s output over every token of ``rows``, one row
    at a time (no padding), read by a forward hook on the layer."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seen: list[torch.Tensor] = []
    hook = model.model.layers[layer].register_forward_hook(
        lambda module, args, out: seen.append((out[0] if isinstance(out, tuple) else out)[0].norm(dim=-1))
    )
    with torch.no_grad():
        for row in rows:
            model(input_ids=torch.tensor([row["input_ids"]]))
    hook.remove()
    return float(torch.cat(seen).mean())


def test_rmu_scales_c_to_the_model_unless_it_is_set(soup_train, unlearn_config, tiny_model, demo_data):
    import json

    from transformers import AutoTokenizer

    from soup_core.default_plugins.sft import encode_rows

    config = unlearn_config("rmu-c", training={"unlearn_method": "rmu", "max_steps": 1})
    del config["training"]["lora"]
    run = soup_train(config)
    params = _eval_record(run)["params"]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [json.loads(line) for line in demo_data["forget"].read_text().splitlines()]
    encoded = encode_rows(rows, tok, max_length=int(config["data"].get("max_length", 512)))
    expected = _layer_norm(tiny_model, encoded, 1)
    assert params["rmu_start_norm"] == pytest.approx(expected, rel=1e-4)
    assert params["rmu_coeff"] == pytest.approx(5 * expected, rel=1e-4)
    # control: another layer's norm is another number, so the steered layer's is the one measured
    assert params["rmu_start_norm"] != pytest.approx(_layer_norm(tiny_model, encoded, 0), rel=1e-2)
    assert "rmu: c = 5 × " in run.output

    config = unlearn_config("rmu-c-set", training={"unlearn_method": "rmu", "max_steps": 1, "unlearn_rmu_coeff": 6.5})
    del config["training"]["lora"]
    params = _eval_record(soup_train(config))["params"]
    assert params["rmu_coeff"] == 6.5 and "rmu_start_norm" not in params  # an explicit c is used as given


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_rmu_through_lora_is_a_named_setting(soup_train, unlearn_config):
    training = {"unlearn_method": "rmu", "unlearn_rmu_params": "lora", "unlearn_rmu_tokens": "answer", "max_steps": 1}
    run = soup_train(unlearn_config("rmu-lora", training=training))
    record = _eval_record(run)
    assert (record["params"]["rmu_params"], record["params"]["rmu_tokens"]) == ("lora", "answer")
    assert (run.output_dir / "adapter_config.json").exists()


def test_a_controller_sets_the_methods_coefficients_and_only_those(soup_train, unlearn_config, plugin_with):
    from soup_core import Controller, SetCoefficient

    class Steer(Controller):
        name = "steer"

        def on_step(self, event):
            if event.step == 1:
                return [SetCoefficient("beta", 0.5), SetCoefficient("alpha", 0.0)]
            return [SetCoefficient("gamma", 1.0)]  # simnpo's, not npo's

    with pytest.raises(TrainingFailed) as failed:
        soup_train(unlearn_config("steer", training={"max_steps": 3}), plugin=plugin_with(controllers=[Steer]))
    text = failed.value.output
    assert "Set beta = 0.5 at step 1" in text and "Set alpha = 0.0 at step 1" in text
    assert "coefficient 'gamma', which the unlearn trainer does not have (it has: alpha, beta)" in text


def test_rmu_averages_over_every_token_by_default_and_over_answers_when_named(torch_one_thread):
    torch = torch_one_thread
    from soup_plugin_unlearn.losses import rmu_forget_loss
    from soup_plugin_unlearn.trainer import UnlearnObjective

    batch = {
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
        "labels": torch.tensor([[-100, -100, 5, 6, -100], [-100, 7, -100, -100, -100]]),
    }
    trainer = UnlearnObjective.__new__(UnlearnObjective)  # rmu_mask reads nothing but rmu_tokens
    trainer.rmu_tokens = "all"
    assert trainer.rmu_mask(batch).tolist() == [[True] * 4 + [False], [True] * 5]  # padding left out
    trainer.rmu_tokens = "answer"
    assert trainer.rmu_mask(batch).tolist() == [[False, True, True, False, False], [True] + [False] * 4]
    # the two give different terms on the same activations (the setting is used, not ignored)
    acts = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    control = torch.ones(4)
    trainer.rmu_tokens = "all"
    every = rmu_forget_loss(acts, trainer.rmu_mask(batch), control).item()
    trainer.rmu_tokens = "answer"
    assert rmu_forget_loss(acts, trainer.rmu_mask(batch), control).item() != pytest.approx(every, rel=1e-3)


def test_rmu_as_published_resumes_from_the_base_not_the_checkpoint(
    soup_train, unlearn_config, torch_one_thread, tiny_model, demo_data
):
    """The starting MLP values are taken before the checkpoint is loaded: a resumed run measures (and holds
    retain activations against) the base, and ends where the uninterrupted run ends."""
    torch = torch_one_thread
    from safetensors.torch import load_file

    training = {"unlearn_method": "rmu", "max_steps": 4, "save_steps": 2, "unlearn_alpha": 1.0}

    def config(name: str, **extra: Any) -> dict[str, Any]:
        made = unlearn_config(name, training={**training, **extra})
        del made["training"]["lora"]
        return made

    full = soup_train(config("full"))
    resumed = soup_train(config("resumed", resume_from=str(full.output_dir / "checkpoint-2")))
    assert resumed.start.resumed_from_step == 2 and [e.step for e in resumed.micro] == [3, 4]
    a = load_file(str(full.output_dir / "model.safetensors"))
    b = load_file(str(resumed.output_dir / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    start_full, start_resumed = _eval_record(full)["start"], _eval_record(resumed)["start"]
    assert start_resumed["forget_loss"] == pytest.approx(start_full["forget_loss"], rel=1e-6)

    def forget_loss(model: Path) -> float:  # plain transformers, token-weighted as the plugin reports it
        losses, counts = _per_row_nll(model, demo_data["forget"], 48)
        return sum(x * n for x, n in zip(losses, counts, strict=True)) / sum(counts)

    assert start_resumed["forget_loss"] == pytest.approx(forget_loss(tiny_model), rel=1e-4)
    # control: the checkpoint's model (what a copy taken after loading it would hold) measures otherwise
    assert start_resumed["forget_loss"] != pytest.approx(forget_loss(full.output_dir / "checkpoint-2"), rel=1e-3)
