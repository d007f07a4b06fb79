"""The memory pre-flight: its exact arithmetic against real stores and real adapters, the table it prints
(in the plan and under ``soup train --dry-run``), and its refusal (with the fixes) under a real memory
limit, which ``training.stream_allow_oom_attempt`` overrides."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from soup_plugin_streaming import plugin, preflight

SRC = Path(plugin.__file__).resolve().parents[1]
ROOT = Path(__file__).resolve().parents[2]


def _shape(folder: Path) -> preflight.ModelShape:
    return preflight.ModelShape.from_config(json.loads((folder / "config.json").read_text()))


@pytest.mark.parametrize(
    ("name", "dtype", "quant", "nested"),
    [
        ("llama", "float32", "none", True),
        ("qwen2", "bfloat16", "none", True),  # q/k/v biases
        ("mistral", "float32", "nf4", True),
        ("tied", "float32", "nf4", False),  # no head in the extras; NF4 without double quantisation
        ("qwen2", "float32", "nf4", True),
    ],
)
def test_store_sizes_are_exact(checkpoints, store_root, torch_one_thread, name, dtype, quant, nested):
    import torch

    from soup_plugin_streaming.testing import make_store

    store = make_store(
        checkpoints[name],
        store_root,
        dtype=getattr(torch, dtype),
        quant=quant,
        double_quant=nested,
        tier="disk",
    )
    shape, e = _shape(checkpoints[name]), torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    layer = preflight.layer_bytes(shape, e, quant, nested)
    assert store.layer_bytes == layer  # one buffer: the union of the layers' tensors
    assert store.store_bytes == layer * shape.layers
    assert int(store.index["extras_bytes"]) == preflight.extras_bytes(shape, e, quant, nested)


def test_the_wrong_shape_would_be_caught(checkpoints, store_root, torch_one_thread):
    """Control: the comparison above sees a one-field difference (qwen2 without its biases)."""
    from dataclasses import replace

    from soup_plugin_streaming.testing import make_store

    store = make_store(checkpoints["qwen2"], store_root, tier="disk")
    wrong = replace(_shape(checkpoints["qwen2"]), qkv_bias=False)
    assert store.layer_bytes != preflight.layer_bytes(wrong, 4)


def test_adapter_count_matches_peft(checkpoints, store_root, torch_one_thread):
    from soup_plugin_streaming.testing import lora_kwargs, streamed

    for name in ("qwen2", "tied"):
        model, _ = streamed(checkpoints[name], store_root, lora=lora_kwargs(r=4))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert trainable == preflight.lora_params(_shape(checkpoints[name]), 4, "auto") > 0
        trained = {p.dtype for p in model.parameters() if p.requires_grad}
        assert trained == {torch_one_thread.float32}  # 16 B each
    shape = _shape(checkpoints["llama"])
    assert preflight.lora_params(shape, 4, ["q_proj", "v_proj"]) == shape.layers * 4 * (
        sum(shape.linears()["q_proj"]) + sum(shape.linears()["v_proj"])
    )


def test_trl_fused_head_tiles_are_what_the_formula_assumes():
    from trl.kernels import chunked_logprob
    from trl.trainer import utils

    assert chunked_logprob.TOKEN_CHUNK_SIZE == preflight.TRL_TOKEN_TILE
    assert utils._CHUNKED_LOGPROB_CHUNK_SIZE == preflight.TRL_VOCAB_TILE


def test_parts_follow_the_settings():
    shape = preflight.ModelShape(
        arch="llama", hidden=512, intermediate=1408, layers=8, heads=8, kv_heads=2, head_dim=64, vocab=16384
    )
    base = preflight.Run(batch=2, seq=256)
    disk, ram = (
        preflight.predict(shape, base),
        preflight.predict(shape, preflight.Run(batch=2, seq=256, tier="ram")),
    )
    assert disk.parts["layer store"] == 0 and ram.parts["layer store"] == preflight.layer_bytes(shape, 4) * 8
    margin = preflight.CPU_FIT["margin"]
    assert ram.total - ram.parts["margin"] - (disk.total - disk.parts["margin"]) == ram.parts["layer store"]
    assert ram.parts["margin"] == pytest.approx(margin * (ram.total - ram.parts["margin"]), abs=1)
    three = preflight.predict(shape, preflight.Run(batch=2, seq=256, buffers=3))
    assert three.parts["buffers"] == 3 * preflight.layer_bytes(shape, 4)
    nf4 = preflight.predict(shape, preflight.Run(batch=2, seq=256, quant="nf4"))
    assert nf4.parts["buffers"] < disk.parts["buffers"] / 6  # about 0.52 of 4 bytes per weight
    # the tile is capped: beyond 4096 positions the logits stop growing, the activations do not
    long_ = preflight.predict(shape, preflight.Run(batch=4, seq=4096))
    longer = preflight.predict(shape, preflight.Run(batch=8, seq=4096))
    assert long_.parts["logits"] == longer.parts["logits"]
    assert longer.parts["activations"] > long_.parts["activations"]
    # only the larger of the logits tile and the recomputed layer counts
    skipped = "recomputed layer" if disk.peak_branch == "logits" else "logits"
    assert disk.total == sum(v for k, v in disk.parts.items() if k != skipped)
    assert disk.parts[skipped] > 0  # it is shown, not counted


def test_the_plan_prints_the_budget_table(checkpoints):
    from soup_core.config import validate_config
    from soup_core.testing import isolated_plugins

    config = validate_config(
        {
            "base": str(checkpoints["llama"]),
            "data": {"train": "rows.jsonl", "max_length": 64},
            "training": {"stream_layers": True, "batch_size": 2},
        },
        plugins=isolated_plugins(("streaming", plugin)),
    )
    report = plugin.soup_preflight(config)
    assert report.refusal is None, report
    text = "\n".join(report.lines)
    assert "streaming the base layer by layer through 2 buffers" in report.lines[0]
    assert "memory budget (cpu, anonymous memory above the process's baseline" in text
    for part in (
        "layer store",
        "buffers",
        "resident",
        "adapters",
        "activations",
        "logits",
        "overhead",
        "margin",
        "total",
    ):
        assert f"\n  {part}" in text, part
    assert "layer store tier: " in text and "MiB available (" in text and ": fits" in text


def test_a_model_without_a_readable_config_skips_the_budget_without_refusing(tmp_path):
    from soup_core.config import validate_config
    from soup_core.testing import isolated_plugins

    config = validate_config(
        {
            "base": "nobody/not-cached-model",
            "data": {"train": "x.jsonl"},
            "training": {"stream_layers": True},
        },
        plugins=isolated_plugins(("streaming", plugin)),
    )
    report = plugin.soup_preflight(config)
    assert report.refusal is None and any("memory budget: skipped (no config.json" in x for x in report.lines)


def test_the_override_is_a_streaming_sub_field(checkpoints):
    from soup_core.config import validate_config
    from soup_core.testing import isolated_plugins

    config = validate_config(
        {"base": "m", "data": {"train": "x.jsonl"}, "training": {"stream_allow_oom_attempt": True}},
        plugins=isolated_plugins(("streaming", plugin)),
    )
    report = plugin.soup_preflight(config)
    assert report.refusal and "training.stream_allow_oom_attempt is set" in report.refusal


_UNDER_A_LIMIT = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    from soup_core.default_plugins.commands.train_cmd import run_train_command
    from soup_core.config import validate_config
    from soup_core.testing import isolated_plugins, registered_plugin
    from soup_plugin_streaming import memwatch, plugin

    base, data, cfg = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    # what the pre-flight and the dry run import and probe, before any limit is set
    import torch, psutil, transformers, trl, peft  # noqa: F401
    plugins = isolated_plugins(("streaming", plugin))
    plugins.requirements_for(backend="transformers", task="sft", deep=True)

    def mapping(allow):
        return {
            "base": base,
            "data": {"train": data, "max_length": 4096},
            "training": {"stream_layers": True, "batch_size": 8, "stream_source": "ram",
                         "stream_allow_oom_attempt": allow},
        }

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    out = {}
    for name, headroom, allow in (("roomy", 4 * 2**30, False), ("tight", 64 * 2**20, False),
                                  ("allowed", 64 * 2**20, True)):
        config = validate_config(mapping(allow), plugins=plugins)
        # a real limit: this process may map only `headroom` more bytes of private writable memory
        resource.setrlimit(resource.RLIMIT_DATA, (memwatch.status()["VmData"] + headroom, hard))
        report = plugin.soup_preflight(config)
        out[name] = {"refusal": report.refusal, "fix": report.fix, "lines": report.lines}
        if name == "tight":  # the same through soup train --dry-run
            cfg.write_text(json.dumps(mapping(allow)))
            with registered_plugin("streaming", plugin):
                out["dry_run_exit"] = run_train_command(cfg, overrides={}, dry_run=True)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.slow
def test_refuses_over_a_real_memory_limit_with_the_fixes_and_the_override_lets_it_try(checkpoints, tmp_path):
    """The budget of a batch of 8 x 4096 tokens (its padding mask alone is 128 MiB) against a real limit:
    RLIMIT_DATA 4 GiB (fits) and 64 MiB (refused, also by soup train --dry-run; allowed with the override)
    above what the process already maps."""
    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _UNDER_A_LIMIT,
            str(checkpoints["llama"]),
            str(data),
            str(tmp_path / "soup.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": f"{SRC}:{ROOT}", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": "/tmp"},
    )
    found = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    assert found, result.stdout[-2000:] + result.stderr[-3000:]
    out = json.loads(found[-1][len("RESULT ") :])
    roomy, refused, allowed = out["roomy"], out["tight"], out["allowed"]
    assert roomy["refusal"] is None and any("(RLIMIT_DATA): fits" in x for x in roomy["lines"]), roomy[
        "lines"
    ]
    assert "exceeds the" in refused["refusal"] and "(RLIMIT_DATA)" in refused["refusal"]
    for fix in ("training.batch_size: 1", "data.max_length: 2048", "training.stream_source: disk", "4bit"):
        assert fix in refused["fix"], refused["fix"]
    assert "training.stream_allow_oom_attempt: true" in refused["fix"]
    assert out["dry_run_exit"] == 1 and "pre-flight check of plugin 'streaming' refused" in result.stderr
    assert allowed["refusal"] is None
    assert any(
        "over budget, trying anyway (training.stream_allow_oom_attempt: true)" in x for x in allowed["lines"]
    )


def test_soup_train_dry_run_prints_the_table(checkpoints, tmp_path, capsys):
    from soup_core.default_plugins.commands.train_cmd import run_train_command
    from soup_core.testing import registered_plugin

    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
    )
    config = tmp_path / "soup.yaml"
    config.write_text(
        f"base: {checkpoints['mistral']}\ndata: {{train: {data}, max_length: 64}}\n"
        "training: {stream_layers: true, quantization: 4bit, stream_buffers: 3}\n"
    )
    with registered_plugin("streaming", plugin):
        assert run_train_command(config, overrides={}, dry_run=True) == 0
    out = capsys.readouterr().out
    assert "memory budget (cpu" in out and "3 x " in out and "NF4" in out and "Dry run passed" in out


def test_the_formula_imports_no_torch():
    code = (
        "import sys; from soup_plugin_streaming import preflight as p, calibration as c; "
        "s = p.ModelShape('llama', 64, 128, 2, 4, 2, 16, 300); "
        "p.render(p.predict(s, p.Run(2, 64)), None, 'x'); "
        "c.check(c.load_grid()['rows'][:2]); "
        "print([m for m in ('torch', 'transformers', 'trl', 'peft', 'bitsandbytes') if m in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": f"{SRC}:{ROOT}", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
