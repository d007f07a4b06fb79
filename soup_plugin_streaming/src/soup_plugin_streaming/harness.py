"""Measuring one ``soup train`` run's memory, in a fresh process (what the calibration grid and the
benchmark are made of), and the locally built models and data they train on.

How one run is measured (:func:`measure`, in its own process: ``python -m soup_plugin_streaming.harness
CONFIG OUT``, through the test kit's :func:`~soup_core.testing.train_in_process`): the streaming plugin is
registered with its own hooks plus two observers that change nothing (and the kit's event recorder). Its
model-loading hook first reads the baseline (``RssAnon``, after the imports, the config and the training
rows, before any model bytes); a recorder opens the measurement window at run start (the model and trainer
are built) and closes it at run end (see :mod:`~soup_plugin_streaming.memwatch`). The recorder wants
micro-batch events, as ``soup rewind``'s does, so the per-row statistics are part of what is measured.

Import-light at module level; torch and the core's training code are imported by the functions that run
models.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: A row's words: tokenised by the tiny byte-level BPE into several tokens each, so a few hundred words
#: exceed any max_length used here.
_WORDS = (
    "alpha beta gamma delta epsilon zeta theta lambda kappa sigma omega matrix vector tensor gradient "
    "layer buffer stream memory budget kernel batch token logits adapter optimizer quantise calibrate"
).split()


# ------------------------------------------------------------------------------------------ inputs


def model_spec(
    arch: str = "llama",
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    vocab: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    tied: bool = False,
) -> dict[str, Any]:
    """A model shape for the grid (heads of 64 dimensions unless given)."""
    heads = heads or max(1, hidden // 64)
    return {
        "arch": arch,
        "hidden": hidden,
        "intermediate": intermediate,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads or heads,
        "vocab": vocab,
        "tied": tied,
    }


def model_key(spec: dict[str, Any]) -> str:
    return (
        f"{spec['arch']}-h{spec['hidden']}-i{spec['intermediate']}-l{spec['layers']}-a{spec['heads']}"
        f"-kv{spec['kv_heads']}-v{spec['vocab']}{'-tied' if spec['tied'] else ''}"
    )


def build_model(folder: Path, spec: dict[str, Any], *, seed: int = 0, tokenizer_vocab: int = 1000) -> Path:
    """A randomly initialised causal LM of shape ``spec`` saved (safetensors) with a tiny tokenizer.

    The model's vocabulary may be larger than the tokenizer's (the extra rows are never read, but they
    are what a real vocabulary costs in embeddings and logits)."""
    import torch
    from soup_core.default_plugins.transformers import build_tiny_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    if (folder / "config.json").is_file() and list(folder.glob("*.safetensors")):
        return folder
    tokenizer = build_tiny_tokenizer(vocab_size=tokenizer_vocab)
    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    config = classes[spec["arch"]](
        vocab_size=max(spec["vocab"], len(tokenizer)),
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=8192,
        tie_word_embeddings=spec["tied"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    import shutil
    import tempfile

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    del model
    try:
        os.replace(tmp, folder)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def write_rows(path: Path, n: int, *, words: int, seed: int = 0, short_every: int = 4) -> Path:
    """Chat rows whose answers run to about ``words`` words; every ``short_every``-th row is short, so
    batches carry padding (and the attention mask that comes with it)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        count = 12 if short_every and i % short_every == short_every - 1 else words
        answer = " ".join(rng.choice(_WORDS) for _ in range(count))
        lines.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"row {i}: tell me about {rng.choice(_WORDS)}"},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
        )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def config_text(
    run: dict[str, Any], *, base: Path, data: Path, output: Path, steps: int, stream: bool = True
) -> str:
    """The ``soup train`` config of one grid row."""
    lora = run.get("lora", {})
    lines = [
        f"base: {base}",
        f"output: {output}",
        "data:",
        f"  train: {data}",
        f"  max_length: {run['seq']}",
        "training:",
        f"  max_steps: {steps}",
        f"  batch_size: {run['batch']}",
        f"  dtype: {run.get('dtype', 'float32')}",
        f"  quantization: {'4bit' if run.get('quant') == 'nf4' else 'none'}",
        "  learning_rate: 0.001",
        "  logging_steps: 1",
        f"  lora: {{r: {lora.get('r', 8)}, alpha: {lora.get('alpha', 16)}, "
        f"dropout: {lora.get('dropout', 0.05)}}}",
    ]
    if run.get("quant") == "nf4":
        lines.append(f"  bnb_4bit_use_double_quant: {str(run.get('double_quant', True)).lower()}")
    if stream:
        lines += [
            "  stream_layers: true",
            f"  stream_buffers: {run['buffers']}",
            f"  stream_source: {run['tier']}",
        ]
    elif run.get("checkpointing"):
        lines.append("  gradient_checkpointing: true")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ measuring one run


def _measuring_plugin(window: Any, events: list[dict[str, Any]]) -> Any:
    """The streaming plugin's hooks, plus the two observers described in the module docstring."""
    from soup_core import Recorder, hookimpl

    from soup_plugin_streaming import memwatch, plugin

    state: dict[str, Any] = {}

    class MemoryRecorder(Recorder):
        name = "memory-window"
        description = "opens the memory window at run start, closes it at run end"
        wants_micro_batches = True

        def on_run_start(self, event: Any) -> None:
            window.start(
                baseline=state.get("baseline"), baseline_rss=state.get("baseline_status", {}).get("VmRSS")
            )
            state["t_start"] = time.perf_counter()

        def on_optimizer_step(self, event: Any) -> None:
            events.append(
                {
                    "step": event.step,
                    "t": round(time.perf_counter() - state["t_start"], 3),
                    "anon": memwatch.anon_now(),
                }
            )

        def on_run_end(self, event: Any) -> None:
            window.stop()

    class Measured:
        SOUP_HOOK_API = plugin.SOUP_HOOK_API
        soup_register_config_fields = staticmethod(plugin.soup_register_config_fields)
        soup_register_support = staticmethod(plugin.soup_register_support)
        soup_register_probes = staticmethod(plugin.soup_register_probes)
        soup_preflight = staticmethod(plugin.soup_preflight)

        @staticmethod
        @hookimpl
        def soup_load_model(config: Any, backend: str, task: Any) -> Any:
            state["baseline"] = memwatch.anon_now()
            state["baseline_status"] = memwatch.status()
            loaded = plugin.soup_load_model(config=config, backend=backend, task=task)
            if loaded is not None and "streaming" in loaded.extra:
                state["runtime"] = loaded.extra["streaming"]
            return loaded

        @staticmethod
        @hookimpl
        def soup_register_recorders() -> list[Any]:
            return [MemoryRecorder]

    Measured.state = state  # type: ignore[attr-defined]
    return Measured


def measure(config_path: Path, out: Path) -> dict[str, Any]:
    """Run ``soup train`` on ``config_path`` in this process and write the measurement to ``out``."""
    import torch

    torch.set_num_threads(1)
    from soup_core.testing import TrainingFailed, train_in_process

    from soup_plugin_streaming import memwatch

    window = memwatch.Window()
    steps: list[dict[str, Any]] = []
    measured = _measuring_plugin(window, steps)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        try:
            train_in_process(config_path, workdir=workdir, plugins=[("streaming", measured)], installed=False)
            code = 0
        except TrainingFailed as failed:
            code = failed.exit_code
    state = measured.state
    result: dict[str, Any] = {
        "exit_code": code,
        "seconds": round(time.perf_counter() - started, 1),
        "steps": steps,
        **window.result,
        "baseline_status": state.get("baseline_status", {}),
    }
    runtime = state.get("runtime")
    if runtime is not None:
        result["runtime"] = {k: v for k, v in runtime.stats().items() if not isinstance(v, float)}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1), encoding="utf-8")
    os.replace(tmp, out)
    return result


def run_in_child(
    config_path: Path,
    out: Path,
    *,
    soup_home: Path,
    rlimit_data: int | None = None,
    timeout: float = 1800,
    log: Path | None = None,
) -> dict[str, Any]:
    """``measure`` in a fresh Python process (one thread), optionally under ``RLIMIT_DATA`` (bytes): the
    kernel then refuses the process any private writable memory past the limit."""
    src = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "SOUP_HOME": str(soup_home),
        "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p),
    }

    def limit() -> None:
        if rlimit_data is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_DATA, (rlimit_data, rlimit_data))

    if out.exists():
        out.unlink()
    cmd = [sys.executable, "-m", "soup_plugin_streaming.harness", str(config_path), str(out)]
    with open(log or os.devnull, "w", encoding="utf-8") as sink:
        proc = subprocess.run(
            cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, preexec_fn=limit
        )
    if not out.exists():
        return {"exit_code": proc.returncode, "failed": True}
    result = json.loads(out.read_text(encoding="utf-8"))
    result["process_exit_code"] = proc.returncode
    return result


def machine() -> dict[str, Any]:
    import platform

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    cpu = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            cpu = next((x.split(":", 1)[1].strip() for x in handle if x.startswith("model name")), None)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}",
        "load_average": [round(x, 2) for x in load] if load else None,
        "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
        if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
        else None,
    }


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m soup_plugin_streaming.harness CONFIG OUT")
    sys.exit(0 if measure(Path(sys.argv[1]), Path(sys.argv[2]))["exit_code"] == 0 else 1)
