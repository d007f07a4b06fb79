"""The layer store: what splitting writes, when it is reused or rebuilt, the tiers, and its memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def _settings(dtype="float32", quant="none", double_quant=True):
    import torch

    from soup_plugin_streaming.store import SplitSettings

    keys = frozenset({"self_attn.q_proj.weight", "mlp.down_proj.weight"}) if quant == "nf4" else frozenset()
    return SplitSettings(
        dtype=getattr(torch, dtype), quant=quant, double_quant=double_quant, quantize_keys=keys
    )


def test_split_files_are_plain_safetensors_holding_the_source_tensors(
    checkpoints, tmp_path, torch_one_thread
):
    import torch
    from safetensors import safe_open

    from soup_plugin_streaming.store import DiskStore, RamStore, ensure_store

    source = checkpoints["qwen2"]
    path = ensure_store(source, _settings(), 2, root=tmp_path, report=lambda line: None)
    assert sorted(p.name for p in path.iterdir()) == [
        "extras.safetensors",
        "index.json",
        "layer_000.safetensors",
        "layer_001.safetensors",
    ]
    with safe_open(str(source / "model.safetensors"), "pt") as src:
        names = list(src.keys())
        for layer in range(2):
            with safe_open(str(path / f"layer_{layer:03d}.safetensors"), "pt") as part:
                prefix = f"model.layers.{layer}."
                assert sorted(part.keys()) == sorted(n[len(prefix) :] for n in names if n.startswith(prefix))
                assert "self_attn.q_proj.bias" in part.keys()  # qwen2's biases travel with their layer
                for key in part.keys():
                    assert torch.equal(part.get_tensor(key), src.get_tensor(prefix + key))
        with safe_open(str(path / "extras.safetensors"), "pt") as extras:
            assert sorted(extras.keys()) == sorted(n for n in names if not n.startswith("model.layers."))
    ram, disk = RamStore.open(path), DiskStore.open(path)
    into = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in disk.union.items()}
    disk.fill(1, into)
    assert all(torch.equal(into[k], ram.host(1)[k]) for k in into)


def test_bf16_store_matches_a_bf16_load(checkpoints, tmp_path, torch_one_thread):
    import torch
    from transformers import AutoModelForCausalLM

    from soup_plugin_streaming.store import RamStore, ensure_store

    path = ensure_store(
        checkpoints["tied"], _settings("bfloat16"), 2, root=tmp_path, report=lambda line: None
    )
    resident = AutoModelForCausalLM.from_pretrained(str(checkpoints["tied"]), dtype=torch.bfloat16)
    store = RamStore.open(path)
    assert store.host(0)["mlp.up_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(store.host(0)["mlp.up_proj.weight"], resident.model.layers[0].mlp.up_proj.weight)
    assert "lm_head.weight" not in store.extras()  # tied: the head is the embedding, restored by tying


def test_reused_while_unchanged_and_rebuilt_when_anything_changes(checkpoints, tmp_path, torch_one_thread):
    import shutil

    from soup_plugin_streaming.store import ensure_store

    source = tmp_path / "model"
    shutil.copytree(checkpoints["llama"], source)
    root = tmp_path / "stores"
    lines: list[str] = []
    first = ensure_store(source, _settings(), 3, root=root, report=lines.append)
    stamp = (first / "layer_000.safetensors").stat().st_mtime_ns
    assert ensure_store(source, _settings(), 3, root=root, report=lines.append) == first
    assert (first / "layer_000.safetensors").stat().st_mtime_ns == stamp
    assert "splitting" in lines[0] and "reusing" in lines[1]
    # other settings: other stores
    others = {
        ensure_store(source, _settings("bfloat16"), 3, root=root, report=lines.append),
        ensure_store(source, _settings(quant="nf4"), 3, root=root, report=lines.append),
        ensure_store(source, _settings(quant="nf4", double_quant=False), 3, root=root, report=lines.append),
    }
    assert len(others) == 3 and first not in others
    # the source changes (a new modification time): rebuilt
    checkpoint = source / "model.safetensors"
    os.utime(checkpoint, ns=(checkpoint.stat().st_atime_ns, checkpoint.stat().st_mtime_ns + 10**9))
    changed = ensure_store(source, _settings(), 3, root=root, report=lines.append)
    assert changed != first and "splitting" in lines[-1]
    # an incomplete store (no index: a split was interrupted) is rebuilt, not used
    (changed / "index.json").unlink()
    assert ensure_store(source, _settings(), 3, root=root, report=lines.append) == changed
    assert "splitting" in lines[-1] and (changed / "index.json").is_file()


def test_sharded_checkpoints_split_too(tokenizer, tmp_path, torch_one_thread):
    import torch
    from safetensors import safe_open

    from soup_plugin_streaming.store import RamStore, ensure_store
    from soup_plugin_streaming.testing import build_tiny_checkpoint

    source = build_tiny_checkpoint(
        tmp_path / "sharded", "llama", layers=3, tokenizer=tokenizer, max_shard_size="100KB"
    )
    shards = sorted(source.glob("model-*.safetensors"))
    assert len(shards) > 1 and (source / "model.safetensors.index.json").is_file()
    store = RamStore.open(ensure_store(source, _settings(), 3, root=tmp_path / "s", report=lambda line: None))
    seen = 0
    for shard in shards:
        with safe_open(str(shard), "pt") as part:
            for name in part.keys():
                if name.startswith("model.layers.2."):
                    assert torch.equal(store.host(2)[name[len("model.layers.2.") :]], part.get_tensor(name))
                    seen += 1
    assert seen == 9


def test_unreadable_sources_are_refused_clearly(tmp_path, torch_one_thread):
    from soup_plugin_streaming.errors import StreamingError
    from soup_plugin_streaming.store import ensure_store

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(StreamingError, match="no safetensors checkpoint.*pytorch_model.bin.*convert"):
        ensure_store(tmp_path / "bin", _settings(), 2, root=tmp_path / "s")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(StreamingError, match="not a safetensors file"):
        ensure_store(tmp_path / "bad", _settings(), 2, root=tmp_path / "s")


def test_auto_tier_says_which_and_why():
    from soup_plugin_streaming.store import choose_tier

    mib = 2**20
    assert choose_tier("auto", 600 * mib, available=1000 * mib) == (
        "ram",
        "auto: it fits in memory with a margin (600.0 MiB store vs 1,000 MiB available)",
    )
    tier, why = choose_tier("auto", 700 * mib, available=1000 * mib)
    assert tier == "disk" and "does not fit in 70% of available memory" in why
    assert choose_tier("ram", 10**15, available=1) == ("ram", "training.stream_source: ram")
    assert choose_tier("disk", 1, available=10**15)[0] == "disk"


# ------------------------------------------------------------------------------------- peak memory

_PEAK = textwrap.dedent(
    """
    import gc, json, sys
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    from soup_plugin_streaming.store import SplitSettings, ensure_store

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    source, mode = Path(sys.argv[1]), sys.argv[2]
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset the peak resident set size (VmHWM) to the current one
    before = status("VmRSS")
    if mode == "split":
        ensure_store(source, SplitSettings(dtype=torch.float32), 8, root=Path(sys.argv[3]), report=print)
    else:
        from safetensors.torch import load_file
        # what loading a model does: every tensor copied into memory the process owns
        tensors = {name: t.clone() for name, t in load_file(str(source / "model.safetensors")).items()}
    print(json.dumps({"peak": status("VmHWM") - before}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc (Linux)")
def test_splitting_holds_about_one_layer_while_loading_holds_the_model(tokenizer, tmp_path, torch_one_thread):
    import json

    from soup_plugin_streaming.testing import build_tiny_checkpoint

    # 8 layers of ~4.2 MB each (fp32) and small extras: a whole-model load is ~8x one layer.
    source = build_tiny_checkpoint(
        tmp_path / "wide", "llama", layers=8, hidden=256, intermediate=1024, vocab=300
    )
    size = (source / "model.safetensors").stat().st_size
    layer = 4 * (256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 1024 + 2 * 256)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}

    def peak(mode: str) -> int:
        result = subprocess.run(
            [sys.executable, "-c", _PEAK, str(source), mode, str(tmp_path / "stores")],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout.strip().splitlines()[-1])["peak"]

    control, split = peak("load"), peak("split")
    assert control > 0.8 * size, f"the control load grew only {control} bytes for a {size}-byte checkpoint"
    margin = 3 * 2**20  # allocator and interpreter slack
    assert split < 1.5 * layer + margin, (
        f"splitting peaked at {split / 2**20:.1f} MiB; one layer is {layer / 2**20:.1f}"
    )
    assert split < control / 3
