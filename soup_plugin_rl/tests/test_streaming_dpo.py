"""dpo, ipo and bco train a streamed model (``training.stream_layers: true``) through ``soup train``
exactly as they train the resident one: the same first-step loss, bit for bit, and the same everything after.

With a fresh adapter the first step's policy equals its reference, so the first-step loss is a constant of
the loss type (dpo: log 2; ipo: (1/(2β))²; bco: 2 log 2) whatever the base computes. Comparing it alone would
be blind, so each run is compared on every tensor its steps produced, by ``torch.equal``: each step's loss
tensor (the first one included), the per-token log-probabilities of every policy forward (with gradient,
through streaming's checkpointed layers) and every reference forward (adapter disabled, under no_grad), the
trainer's logs at full precision (loss, grad norm, evaluation loss), the per-pair losses the recorders get and
the saved adapter. The control moves one base weight matrix up by one float32 step in the streamed arm: the
first-step loss stays equal (the blind spot above) while the log-probabilities, a later loss and the adapter
differ.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

streaming_plugin = pytest.importorskip(
    "soup_plugin_streaming.plugin", reason="soup-plugin-streaming is not installed: nothing streams"
)

pytestmark = pytest.mark.slow

TASKS = ["dpo", "ipo", "bco"]
#: eval at step 2 runs the no-grad policy too (training.lora.dropout is refused: trl turns dropout off)
TRAINING = {"lora": {"r": 4, "alpha": 8}, "dtype": "float32", "max_steps": 3, "eval_steps": 2}
DATA = {"val_split": 0.25}
STREAM = {"stream_layers": True, "stream_source": "disk", "stream_buffers": 2}
TIMING = ("runtime", "per_second")  # wall-clock numbers differ between any two runs


#: the streaming plugin, beside the capturing rl plugin that ``rl_run`` installs
WITH_STREAMING = [("streaming", streaming_plugin)]


def _logs(result: Any) -> list[dict[str, Any]]:
    history = result.trainer.state.log_history
    return [{k: v for k, v in entry.items() if not k.endswith(TIMING)} for entry in history]


def _adapter(result: Any) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(result.output_dir / "adapter_model.safetensors"))


def differences(a: Any, b: Any) -> list[str]:
    """What differs between two runs (``rl_run`` results), compared exactly; empty when they are the same
    run bit for bit."""
    import torch

    out = []
    if len(a.calls) != len(b.calls) or not a.calls:
        return [f"steps: {len(a.calls)} vs {len(b.calls)}"]
    for step, (x, y) in enumerate(zip(a.calls, b.calls, strict=True), 1):
        if not torch.equal(x["loss"], y["loss"]):
            out.append(f"step {step} loss ({float(x['loss']):.9g} vs {float(y['loss']):.9g})")
        kinds = ["policy" if o.log_probs.requires_grad else "reference" for o in x["outputs"]]
        assert kinds == ["policy", "reference"], kinds  # one forward of each per step, so none goes unseen
        for kind, p, q in zip(kinds, x["outputs"], y["outputs"], strict=True):
            if not torch.equal(p.log_probs, q.log_probs):
                out.append(f"step {step} {kind} log-probs")
    if _logs(a) != _logs(b):
        out.append("trainer logs (loss, grad norm, eval loss)")
    if [e.row_loss for e in a.events.micro] != [e.row_loss for e in b.events.micro]:
        out.append("per-pair losses")
    ta, tb = _adapter(a), _adapter(b)
    if ta.keys() != tb.keys() or not all(torch.equal(ta[k], tb[k]) for k in ta):
        out.append("saved adapter")
    return out


def _check_streamed(result: Any) -> None:
    """The run really trained the streamed model, and trained it."""
    assert result.code == 0
    model = result.trainer.model
    runtime = getattr(model, "soup_streaming", None)
    assert runtime is not None, f"{type(model).__name__} is not a streamed model"
    assert runtime.pool.stats["loads"] >= model.config.num_hidden_layers
    assert list(model.peft_config) == ["default"]  # the reference is the base with the adapter disabled
    assert any("eval_loss" in entry for entry in result.trainer.state.log_history)
    losses = [float(c["loss"]) for c in result.calls]
    assert len(set(losses)) == len(losses)  # the loss moves: the adapter trains


@pytest.mark.parametrize(
    "task,dtype", [("dpo", "float32"), ("ipo", "float32"), ("bco", "float32"), ("dpo", "bfloat16")]
)
def test_streamed_run_equals_the_resident_run_bit_for_bit(shared_run, task, dtype):
    import torch

    training = {**TRAINING, "dtype": dtype}
    streamed = shared_run(task, training={**training, **STREAM}, data=DATA, plugins=WITH_STREAMING)
    resident = shared_run(task, training=training, data=DATA)
    _check_streamed(streamed)
    assert resident.code == 0 and not hasattr(resident.trainer.model, "soup_streaming")
    # the acceptance check itself: the first step's loss tensor, as the trainer computed it
    assert torch.equal(streamed.calls[0]["loss"], resident.calls[0]["loss"])
    assert differences(streamed, resident) == []


def _nudged_copy(source: Path, dest: Path) -> Path:
    """``source`` with one weight matrix of its last decoder layer moved up by one float32 step, element by
    element (one element alone is lost in the rounding of the sums it takes part in)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    (name,) = [k for k in tensors if k.endswith("layers.1.mlp.down_proj.weight")]
    weight = tensors[name]
    tensors[name] = torch.nextafter(weight, torch.full_like(weight, float("inf")))
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_control_one_float_step_in_one_base_weight_matrix_is_seen(shared_run, tiny_model, tmp_path_factory):
    import torch

    nudged = _nudged_copy(tiny_model, tmp_path_factory.mktemp("nudged") / "model")
    streamed = shared_run(
        "dpo", training={**TRAINING, **STREAM}, data=DATA, plugins=WITH_STREAMING, base=nudged
    )
    resident = shared_run("dpo", training=TRAINING, data=DATA)
    _check_streamed(streamed)
    # the blind spot: a fresh adapter makes the first dpo loss log 2 whatever the base computes ...
    assert torch.equal(streamed.calls[0]["loss"], resident.calls[0]["loss"])
    # ... which is why every forward, log and weight is compared as well, and these see the nudge
    found = differences(streamed, resident)
    # every forward of every step sees it (whether it also reaches the loss and the adapter depends on the
    # optimizer: Adam's first steps move each weight by ±lr whatever the gradient's last bits)
    for step in (1, 2, 3):
        for kind in ("policy", "reference"):
            assert f"step {step} {kind} log-probs" in found, found


def test_a_pre_trained_adapter_on_a_streamed_model_is_refused(tiny_model, tmp_path, torch_one_thread):
    """trl keeps a copy of a pre-trained adapter as the reference; on a streamed model PEFT puts that copy on
    the meta device (the base layers' device), so it is refused by name instead of failing mid-step."""
    from types import SimpleNamespace

    from soup_plugin_streaming import testing

    from soup_core.default_plugins.transformers import BackendError
    from soup_plugin_rl.common import use_disabled_adapters_as_reference

    def with_trl_copy(model):  # what trl's DPOTrainer does to a PEFT model it did not wrap
        model.add_adapter("ref", model.peft_config["default"])
        params = dict(model.named_parameters())
        for name, param in params.items():
            if ".default." in name:
                params[name.replace(".default.", ".ref.")].data.copy_(param.data)
        return SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m))

    fresh, _ = testing.streamed(tiny_model, tmp_path)
    line = use_disabled_adapters_as_reference(with_trl_copy(fresh), print)
    assert "adapter disabled" in line and list(fresh.peft_config) == ["default"]
    trained, _ = testing.streamed(tiny_model, tmp_path)
    assert testing.randomize_lora_b([trained]) > 0
    with pytest.raises(BackendError, match="cannot live in a model whose base layers are streamed"):
        use_disabled_adapters_as_reference(with_trl_copy(trained), print)
    # control: the same pre-trained adapter on the resident model keeps trl's copy
    resident = testing.resident(tiny_model)
    testing.randomize_lora_b([resident])
    said: list[str] = []
    line = use_disabled_adapters_as_reference(with_trl_copy(resident), said.append)
    assert "copy" in line and list(resident.peft_config) == ["default", "ref"] and said


def test_tasks_without_the_streamable_capability_are_refused(rl_run, capsys, tmp_path):
    import soup_core.plugins
    from soup_core import load_config
    from soup_core.testing import isolated_plugins
    from soup_plugin_rl import plugin as rl
    from soup_plugin_rl.tasks import TASKS as ALL

    streamable = sorted(t.name for t in ALL if "streamable" in t.capabilities)
    assert streamable == ["bco", "dpo", "ipo"]
    # soup train: the support table already refuses the streaming fields for kto, before anything loads
    result = rl_run("kto", training={"stream_layers": True}, plugins=WITH_STREAMING)
    out = capsys.readouterr()
    assert result.code == 1 and result.trainers == []
    expected = "training.stream_layers: not honoured by backend 'transformers' with task 'kto'"
    assert expected in out.out + out.err
    # and the streaming pre-flight names the capability for every rl task that lacks it
    path = tmp_path / "dpo.yaml"
    path.write_text(
        f"base: {tmp_path}\ntask: dpo\ndata: {{train: x.jsonl}}\ntraining: {{stream_layers: true}}\n",
        encoding="utf-8",
    )
    plugins = isolated_plugins(("rl", rl), ("streaming", streaming_plugin))
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(soup_core.plugins, "load_plugins", lambda *a, **k: plugins)
        config = load_config(path, plugins=plugins)
        for task in sorted(t.name for t in ALL):
            reasons = [r for r, _ in streaming_plugin.refusals(config.model_copy(update={"task": task}))]
            refused = any("does not offer the 'streamable' capability" in r for r in reasons)
            assert refused == (task not in streamable), (task, reasons)
        report = streaming_plugin.soup_preflight(config.model_copy(update={"task": "kto"}))
    assert report.refusal and "task 'kto' does not offer the 'streamable' capability" in report.refusal
    assert report.fix and "training.stream_layers: false" in report.fix
