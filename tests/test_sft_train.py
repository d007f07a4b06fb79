"""End-to-end runs of the built-in transformers backend and sft task on the tiny model (CPU, real trl/peft).

Outputs load in their ecosystems and reproduce the trained model exactly; resume, controllers, every exit
path's run-end event, evaluation, the progress display and merging.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _probe_ids(torch):
    return torch.tensor([[1, 5, 204, 393, 81, 337, 609, 84, 90, 2, 17, 300]])


def _logits(model, torch):
    model.eval()
    with torch.no_grad():
        return model(input_ids=_probe_ids(torch), use_cache=False).logits


def test_lora_adapter_loads_with_peft_and_reproduces_the_trained_model(
    sft_run, make_chat_rows, tiny_model_dir, torch_one_thread
):
    torch = torch_one_thread
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, recorder = sft_run(make_chat_rows(8), training={"max_steps": 2, "learning_rate": 5e-3})
    summary = run.run()
    out = Path(summary["output_dir"])
    assert summary["status"] == "completed" and summary["adapter"] is True
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert AutoTokenizer.from_pretrained(out).chat_template == run.setup.tokenizer.chat_template

    trained = _logits(run.trainer.model, torch)
    lora_b = [p for n, p in run.trainer.model.named_parameters() if "lora_B" in n]
    assert lora_b and any(bool(p.abs().sum() > 0) for p in lora_b)  # the adapter really moved

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    assert torch.equal(_logits(reloaded, torch), trained)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # control: the adapter matters
    assert not torch.equal(_logits(base, torch), trained)

    assert [e.status for e in recorder.ends] == ["completed"]
    assert len(recorder.starts) == 1 and recorder.starts[0].resumed_from_step is None
    assert [s.step for s in recorder.steps] == [1, 2]
    assert set(recorder.steps[0].metrics) == {"loss", "learning_rate", "grad_norm", "update_ratio"}


def test_full_fine_tune_saves_a_model_that_reproduces_the_trained_one(
    sft_run, make_chat_rows, tiny_model_dir, torch_one_thread
):
    torch = torch_one_thread
    from transformers import AutoModelForCausalLM

    run, _ = sft_run(make_chat_rows(8), training={"max_steps": 2, "learning_rate": 1e-3, "lora": {"r": 0}})
    summary = run.run()
    out = Path(summary["output_dir"])
    assert summary["adapter"] is False and not (out / "adapter_config.json").exists()
    assert summary["trainable_parameters"] == sum(p.numel() for p in run.trainer.model.parameters())
    trained = _logits(run.trainer.model, torch)
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out), torch), trained)
    assert not torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir), torch), trained)


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_quantized_lora_trains_on_cpu(sft_run, make_chat_rows, torch_one_thread, bits):
    import bitsandbytes as bnb

    extra = {"bnb_4bit_use_double_quant": False} if bits == "4bit" else {}
    run, recorder = sft_run(make_chat_rows(8), training={"max_steps": 2, "quantization": bits, **extra})
    layer = bnb.nn.Linear4bit if bits == "4bit" else bnb.nn.Linear8bitLt
    quantized = [m for m in run.trainer.model.modules() if isinstance(m, layer)]
    assert quantized
    if bits == "4bit":
        assert all(m.weight.quant_state.nested is False for m in quantized)
    summary = run.run()
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"])
    assert all(n > 0 for e in recorder.micro for n in e.row_tokens)
    assert (Path(summary["output_dir"]) / "adapter_model.safetensors").is_file()


def test_resume_continues_the_same_rows_and_weights(sft_run, make_chat_rows, tmp_path, torch_one_thread):
    torch = torch_one_thread
    from safetensors.torch import load_file

    rows = make_chat_rows(10)
    training = {"max_steps": 4, "save_steps": 2, "learning_rate": 5e-3, "lora": {"dropout": 0.0}}
    first, rec_a = sft_run(rows, training=training, output=tmp_path / "a")
    first.run()
    straight = load_file(tmp_path / "a" / "adapter_model.safetensors")
    checkpoint = tmp_path / "a" / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").is_file()

    second, rec_b = sft_run(
        rows, training={**training, "resume_from": str(checkpoint)}, output=tmp_path / "b", resume_from=str(checkpoint)
    )
    summary = second.run()
    assert rec_b.starts[0].resumed_from_step == 2 and summary["resumed_from_step"] == 2
    assert [e.step for e in rec_b.micro] == [3, 4]
    assert [e.rows for e in rec_b.micro] == [e.rows for e in rec_a.micro if e.step > 2]
    resumed = load_file(tmp_path / "b" / "adapter_model.safetensors")
    assert straight.keys() == resumed.keys() and len(straight) > 0
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    # Control: the checkpoint itself differs from the end state, so equality above is not trivial.
    at_two = load_file(checkpoint / "adapter_model.safetensors")
    assert any(not torch.equal(at_two[k], straight[k]) for k in straight)


@pytest.mark.parametrize(
    ("fmt", "rows"),
    [
        (
            "chat",
            [
                {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
                for i in range(6)
            ],
        ),
        ("alpaca", [{"instruction": f"say {i}", "input": "", "output": f"{i}!"} for i in range(6)]),
        ("prompt_completion", [{"prompt": f"count {i}:", "completion": f" {i + 1}"} for i in range(6)]),
        ("text", [{"text": f"line number {i} of plain text"} for i in range(6)]),
    ],
)
def test_every_data_format_trains(sft_run, fmt, rows):
    run, recorder = sft_run(rows, data={"format": fmt}, training={"max_steps": 1})
    assert run.ctx.training.format == fmt
    assert run.run()["steps"] == 1
    assert len({r for e in recorder.micro for r in e.rows} & set(range(6))) == 4
    assert all(
        n > 0 and math.isfinite(loss) for e in recorder.micro for loss, n in zip(e.row_loss, e.row_tokens, strict=True)
    )


# ------------------------------------------------------------------------------------------ controllers


class _Controller:
    name = "scripted"
    tasks = ()

    def __init__(self, script):
        self.script = script  # step -> actions

    def on_run_start(self, event):
        pass

    def on_step(self, event):
        action = self.script.get(event.step, ())
        if isinstance(action, BaseException):
            raise action
        return action


def test_stop_action_ends_the_run_stopped(sft_run, make_chat_rows):
    from soup_core.contracts import Stop

    run, recorder = sft_run(
        make_chat_rows(8), training={"max_steps": 5}, controllers=[_Controller({2: [Stop("enough")]})]
    )
    summary = run.run()
    assert summary["status"] == "stopped" and summary["stop_reason"] == "enough" and summary["steps"] == 2
    assert [(e.status, e.steps) for e in recorder.ends] == [("stopped", 2)]
    assert (Path(summary["output_dir"]) / "adapter_model.safetensors").is_file()


def test_rollback_restores_the_checkpoint(sft_run, make_chat_rows, tmp_path, torch_one_thread):
    torch = torch_one_thread
    from safetensors.torch import load_file

    from soup_core.contracts import Rollback, Stop

    training = {"max_steps": 6, "save_steps": 2, "learning_rate": 5e-3}
    reports: list[str] = []
    run, _ = sft_run(
        make_chat_rows(8),
        training=training,
        output=tmp_path / "r",
        reports=reports,
        controllers=[_Controller({3: [Rollback(reason="spike"), Stop("after rollback")]})],
    )
    run.run()
    assert run.trainer.soup_rollbacks == [str(tmp_path / "r" / "checkpoint-2")]
    assert any("Rolled back" in line and "spike" in line for line in reports)
    at_two = load_file(tmp_path / "r" / "checkpoint-2" / "adapter_model.safetensors")
    final = load_file(tmp_path / "r" / "adapter_model.safetensors")
    assert at_two.keys() == final.keys() and all(torch.equal(at_two[k], final[k]) for k in at_two)

    # Control: the same run stopped at step 3 without the rollback ends elsewhere.
    plain, _ = sft_run(
        make_chat_rows(8),
        training=training,
        output=tmp_path / "p",
        controllers=[_Controller({3: [Stop("no rollback")]})],
    )
    plain.run()
    other = load_file(tmp_path / "p" / "adapter_model.safetensors")
    assert any(not torch.equal(at_two[k], other[k]) for k in at_two)


def test_unknown_coefficient_fails_the_run_with_a_clear_message(sft_run, make_chat_rows):
    from soup_core.contracts import SetCoefficient
    from soup_core.default_plugins.transformers import BackendError

    run, recorder = sft_run(make_chat_rows(8), controllers=[_Controller({1: [SetCoefficient("beta", 0.2)]})])
    with pytest.raises(BackendError, match="coefficient 'beta'"):
        run.run()
    assert [e.status for e in recorder.ends] == ["failed"] and "beta" in recorder.ends[0].error


def test_interrupt_ends_the_run_interrupted(sft_run, make_chat_rows):
    run, recorder = sft_run(
        make_chat_rows(8), training={"max_steps": 4}, controllers=[_Controller({2: KeyboardInterrupt()})]
    )
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert [(e.status, e.steps) for e in recorder.ends] == [("interrupted", 2)]


# ------------------------------------------------------------------------------- eval, display, merge


def test_evaluation_on_the_validation_rows_reaches_the_tracker(sft_run, make_chat_rows):
    metrics: list = []
    run, recorder = sft_run(
        make_chat_rows(10), data={"val_split": 0.2}, training={"max_steps": 2, "eval_steps": 1}, metrics=metrics
    )
    assert len(run.trainer.eval_dataset) == 2 and len(run.trainer.train_dataset) == 8
    run.run()
    evals = [(step, m["eval_loss"]) for step, m in metrics if "eval_loss" in m]
    assert [step for step, _ in evals] == [1, 2] and all(math.isfinite(v) for _, v in evals)
    assert all(r < 8 for e in recorder.micro for r in e.rows)  # validation rows never train
    assert [e.step for e in recorder.steps if "loss" in e.metrics] == [1, 2]  # the tracker recorder's feed


def test_progress_prints_one_line_per_logging_step_when_not_a_tty(sft_run, make_chat_rows):
    reports: list[str] = []
    run, _ = sft_run(make_chat_rows(8), training={"max_steps": 4, "batch_size": 2, "logging_steps": 2}, reports=reports)
    run.setup.progress.tty = False
    run.run()
    lines = [line for line in reports if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"]
    assert all("loss" in line and "tok/s" in line and "eta" in line for line in lines)


def test_progress_bar_on_a_tty_prints_no_lines():
    import io

    from rich.console import Console

    from soup_core.default_plugins.transformers.progress import ProgressDisplay

    lines: list[str] = []
    buffer = io.StringIO()
    display = ProgressDisplay(
        logging_steps=1, report=lines.append, tty=True, console=Console(file=buffer, force_terminal=True, width=100)
    )
    display.start(3)
    for step in (1, 2, 3):
        display.update(step, {"loss": 1.5, "learning_rate": 1e-4}, 100 * step)
    display.close()
    assert lines == [] and "3/3" in buffer.getvalue() and "loss 1.5000" in buffer.getvalue()


def test_merge_adapter_writes_a_plain_model(sft_run, make_chat_rows, tiny_model_dir, tmp_path, torch_one_thread):
    torch = torch_one_thread
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from soup_core.default_plugins.transformers import BackendError, merge_adapter

    run, _ = sft_run(make_chat_rows(8), training={"max_steps": 2, "learning_rate": 5e-3})
    out = Path(run.run()["output_dir"])
    merged_dir = merge_adapter(tiny_model_dir, out, tmp_path / "merged")
    assert not (merged_dir / "adapter_config.json").exists() and (merged_dir / "tokenizer_config.json").is_file()
    merged = _logits(AutoModelForCausalLM.from_pretrained(merged_dir), torch)
    adapted = _logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out), torch)
    base = _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir), torch)
    assert torch.allclose(merged, adapted, atol=1e-5) and not torch.allclose(merged, base, atol=1e-5)
    with pytest.raises(BackendError, match="not empty"):
        merge_adapter(tiny_model_dir, out, merged_dir)
    with pytest.raises(BackendError, match="no PEFT adapter"):
        merge_adapter(tiny_model_dir, tmp_path, tmp_path / "elsewhere")


def test_bad_model_inputs_get_one_clear_message(sft_run, make_chat_rows, tmp_path):
    from soup_core.default_plugins.transformers import BackendError

    with pytest.raises(BackendError, match="does not exist"):
        sft_run(make_chat_rows(4), base=str(tmp_path / "no-such-model"))
    with pytest.raises(BackendError, match="wq_proj not found"):
        sft_run(make_chat_rows(4), training={"lora": {"target_modules": ["wq_proj"]}})
    with pytest.raises(BackendError, match="not a checkpoint folder"):
        sft_run(make_chat_rows(4), resume_from=str(tmp_path))
