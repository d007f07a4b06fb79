"""``soup export --to gguf`` on the tiny model: a trained LoRA run (merged first) in each type, read back by
transformers (``gguf_file=``) and by the gguf package's reader; qwen2; --type same; the refusals.

How close each type must be (derived from the type's rounding, not tuned): every weight transformers reads back
from the file is the merged weight rounded as the type rounds it, recomputed here independently in torch and
compared with ``torch.equal``:

- f32: the weight itself (no rounding);
- f16: round to nearest even with an 11-bit significand: |w' - w| <= 2**-11 |w| (normal range), 2**-25 below it;
- bf16: round to nearest even with an 8-bit significand, f32's exponent range: |w' - w| <= 2**-8 |w|;
- q8_0: per block of 32 weights of a row, d = max|w| / 127, q = round(w / d) (half away from zero), w' = q f16(d):
  |w' - w| <= d/2 + 127 |f16(d) - d| <= d/2 + 127 d 2**-11.

These bounds are checked on every weight. A model holding exactly those weights computes exactly the same logits,
so the export's logits on 20 held-out prompts must equal those of the merged model with its weights so rounded
within 1e-5 (float32 arithmetic of one computation in two loaders), and, for f32, the merged model's own. Control:
each rounding moves the logits by more than 1e-5, so a file written in another type than asked fails.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PROMPTS = [f"What is {a} plus {b}?" for a, b in zip(range(3, 23), range(40, 20, -1), strict=True)]  # 20, held out
U = {"f16": 2.0**-11, "bf16": 2.0**-8}


def _rounded(weight, kind: str):
    """``weight`` (float32) rounded as the GGUF type ``kind`` rounds it, in float32 (torch, not the gguf package)."""
    import torch

    if kind == "f32" or weight.dim() < 2:
        return weight.clone()
    if kind == "f16":
        return weight.to(torch.float16).float()
    if kind == "bf16":
        return weight.to(torch.bfloat16).float()
    blocks = weight.reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (q * d.to(torch.float16).float()).reshape(weight.shape)


def _bound(weight, kind: str):
    """The largest |rounded - weight| each element may have under ``kind`` (see the module's docstring)."""
    import torch

    if kind == "f32" or weight.dim() < 2:
        return torch.zeros_like(weight)
    if kind == "f16":
        return torch.maximum(weight.abs() * U["f16"], torch.full_like(weight, 2.0**-25))
    if kind == "bf16":
        return weight.abs() * U["bf16"]
    d = weight.reshape(-1, 32).abs().amax(dim=1, keepdim=True) / 127
    return (d / 2 + 127 * d * 2.0**-11 + 2.0**-25).expand(-1, 32).reshape(weight.shape)


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return torch.cat([model(torch.tensor([row])).logits[0, -1:] for row in ids])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model: Path):
    """A LoRA run of the tiny model on sums (3 steps at a high rate: its adapter moves the logits)."""
    from soup_core.testing import train_in_process, write_jsonl

    work = tmp_path_factory.mktemp("gguf-run")
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {a + 1}?"},
                          {"role": "assistant", "content": f"{a + a + 1}"}]} for a in range(50, 66)]
    data = write_jsonl(work / "train.jsonl", rows)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOUP_HOME", str(work / "home"))
        result = train_in_process({"data": {"train": str(data), "max_length": 64, "chat_template": "chatml"},
                                   "training": {"batch_size": 4, "learning_rate": 0.01, "max_steps": 3,
                                                "lora": {"dropout": 0.0}}},
                                  workdir=work, default_base=tiny_model)
    return work / "home", result


def test_a_trained_run_exports_in_each_type_and_loads_in_transformers(
        lora_run, tiny_model: Path, tmp_path: Path, soup, monkeypatch, torch_one_thread, capsys) -> None:
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.transformers import merge_adapter

    home, run = lora_run
    monkeypatch.setenv("SOUP_HOME", str(home))
    merged_dir = merge_adapter(str(tiny_model), run.output_dir, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(merged_dir))
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"] for p in PROMPTS]
    merged_logits = _logits(merged, ids)
    merged_weights = merged.state_dict()
    for kind in ("f32", "f16", "bf16", "q8_0"):
        out = tmp_path / f"tiny-{kind}.gguf"
        assert soup("export", "latest", "--to", "gguf", "--type", kind, "-o", out) == 0
        printed = capsys.readouterr().out
        reader = gguf.GGUFReader(str(out))
        n = len(reader.tensors)
        assert "merging the adapter" in printed and f"{out.name}: {n}/{n} tensors (100%)" in printed
        expected = {"token_embd.weight", "output_norm.weight"} | {
            f"blk.{i}.{n}.weight" for i in range(2) for n in
            ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_norm", "ffn_norm")}
        assert ("output.weight" in {t.name for t in reader.tensors}) != merged.config.tie_word_embeddings
        assert {t.name for t in reader.tensors} - {"output.weight"} == expected
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        assert all(v == ("F32" if "norm" in k else kind.upper()) for k, v in types.items()), types

        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=out.name, dtype=torch.float32).eval()
        reference = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
        with torch.no_grad():
            for name, weight in reference.state_dict().items():
                got = loaded.state_dict()[name]
                assert (got - merged_weights[name]).abs().le(_bound(merged_weights[name], kind)).all(), (kind, name)
                assert torch.equal(got, _rounded(merged_weights[name], kind)), (kind, name)
                weight.copy_(_rounded(weight, kind))
        got_logits = _logits(loaded, ids)
        assert (got_logits - _logits(reference, ids)).abs().max() < 1e-5, kind
        moved = (got_logits - merged_logits).abs().max()
        assert moved < 1e-5 if kind == "f32" else moved > 1e-5, (kind, moved)  # control: the rounding shows
        card = out.with_suffix(".md").read_text(encoding="utf-8")
        assert f"| SHA-256 | `{_sha(out)}` |" in card and "GGUF base" not in card  # the tiny base is a folder


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_qwen2_exports_with_its_biases(tmp_path: Path, soup, torch_one_thread) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from soup_core.default_plugins.transformers import tiny_model_dir

    folder = tiny_model_dir(tmp_path / "tiny", arch="qwen2")
    out = tmp_path / "qwen2.gguf"
    assert soup("export", folder, "--to", "gguf", "--type", "f32", "-o", out) == 0
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=out.name, dtype=torch.float32).eval()
    source = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    for name, weight in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], weight), name
    ids = [[1, 40, 50, 60, 70, 80], [5, 6, 7, 300, 301, 302]]
    assert (_logits(loaded, ids) - _logits(source, ids)).abs().max() < 1e-5


def test_type_same_keeps_the_gguf_base_types_and_names_what_it_cannot_write(
        tiny_gguf: Path, tmp_path: Path, soup, monkeypatch, capsys) -> None:
    import gguf

    import soup_plugin_gguf.convert as convert

    out = tmp_path / "same.gguf"
    assert soup("export", tiny_gguf, "--to", "gguf", "--type", "same", "-o", out) == 0
    types = lambda p: {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(p)).tensors}  # noqa: E731
    assert types(out) == types(tiny_gguf) and "Q8_0" in types(out).values()
    card = out.with_suffix(".md").read_text(encoding="utf-8")
    assert f"| GGUF base SHA-256 | `{_sha(tiny_gguf)}` |" in card and f"| SHA-256 | `{_sha(out)}` |" in card
    capsys.readouterr()

    monkeypatch.setattr(convert, "writable_types", lambda: ["F32", "F16"])  # a gguf package without Q8_0
    assert soup("export", tiny_gguf, "--to", "gguf", "--type", "same", "-o", tmp_path / "no.gguf") == 1
    err = capsys.readouterr().err
    assert "holds Q8_0 tensors, which the installed gguf package cannot write; it writes F32, F16" in err
    assert not (tmp_path / "no.gguf").exists()


def test_bad_input_is_one_plain_message_exit_1_and_no_file(tiny_model: Path, tmp_path: Path, soup, capsys) -> None:
    from soup_core.default_plugins.transformers import tiny_model_dir

    assert soup("export", tmp_path / "nowhere", "--to", "gguf", "-o", tmp_path / "a.gguf") == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "no such folder, and no run matches it" in err and "Traceback" not in err

    mistral = tiny_model_dir(tmp_path / "tiny", arch="mistral")
    assert soup("export", mistral, "--to", "gguf", "-o", tmp_path / "b.gguf") == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "architecture MistralForCausalLM is not one soup export --to gguf" in err

    assert soup("export", tiny_model, "--to", "gguf", "--type", "q4_k", "-o", tmp_path / "c.gguf") == 1
    assert "--type q4_k: choose one of f32, f16, bf16, q8_0, or same" in capsys.readouterr().err
    assert soup("export", tiny_model, "--to", "gguf", "--base", "x", "-o", tmp_path / "c.gguf") == 1
    assert "--base does not apply to --to gguf" in capsys.readouterr().err
    assert soup("export", tiny_model, "--to", "ollama", "-o", tmp_path / "ollama") == 1
    assert "has a chat template that is not one Soup ships" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # nothing written, not even a temporary file

    # a full disk: the file may grow to 100 kB only (the f32 file is ~0.6 MB)
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), not the process

    out = tmp_path / "full" / "d.gguf"
    code = "import sys; from soup_core.cli.main import main; main(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, "export", str(tiny_model), "--to", "gguf", "--type", "f32",
                           "-o", str(out)], capture_output=True, text=True, preexec_fn=limit, env=dict(os.environ),
                          timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.count("error:") == 1 and f"cannot write {out}: " in proc.stderr
    assert "the disk is full or a file size limit was reached" in proc.stderr and "Traceback" not in proc.stderr
    assert list(out.parent.iterdir()) == []  # no half-written file, no temporary one
