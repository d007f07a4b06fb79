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
    the process's anonymous memory over the training steps, above its baseline just before the model is
    built): streamed from disk, streamed from RAM, resident with and without checkpointing. Goal: disk tier
    / resident <= 0.35. The resident arms run with the same allocator setting the streaming plugin applies
    on the CPU (``MALLOC_MMAP_THRESHOLD_=65536``), so the comparison is of tensors, not of allocators.
    Then once for real: a 5.1 GB model (hidden 2048, 24 layers, 1.27B parameters) trains from the disk tier
    in a process whose private writable memory is capped below its weights with ``RLIMIT_DATA`` (set with
    ``setrlimit`` in the child, what ``prlimit --data`` does; a cgroup is not available to us here). The
    cap bounds every anonymous byte the process can have, and the same cap makes the resident run fail.
(c) The pre-flight's prediction for every streamed run of (b), against what was measured.

``--device cuda`` runs (a) on the GPU (bfloat16, RAM tier pinned), the peak device memory of a streamed
step against the pre-flight's device budget, and the share of the step the compute stream stands waiting
for a layer copy (CUDA events around each wait).

Usage: python benchmarks/streaming.py [--device cpu|cuda] [--rounds 4] [--steps 2] [--record]
       [--skip speed,memory,larger]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
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

from soup_plugin_streaming import harness, preflight  # noqa: E402

RESULTS = HERE / "results"
BENCH = harness.model_spec("llama", hidden=1024, intermediate=2816, layers=16, vocab=8192)
BIG = harness.model_spec("llama", hidden=2048, intermediate=5632, layers=24, vocab=8192)
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": list(preflight.LLAMA_LIKE)}
SHARED_NOTE = (
    "2 CPU cores shared with other jobs (other developers' tests) running at the same time; absolute "
    "times are noisy, so speed is compared as ratios of interleaved steps"
)


def machine() -> dict[str, Any]:
    import torch

    info = harness.machine()
    info["torch"] = torch.__version__
    info["threads"] = torch.get_num_threads()
    info["processor"] = platform.processor() or None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


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
    out = {
        "ok": result.get("exit_code") == 0,
        "peak_anon_above_baseline": result.get("peak_above_baseline"),
        "peak_rss_above_baseline": result.get("peak_rss_above_baseline"),
        "file_backed_at_end": result.get("end", {}).get("RssFile"),
        "baseline_anon": result.get("baseline_anon"),
        "seconds": result.get("seconds"),
    }
    if not out["ok"]:
        out["error"] = next((x for x in result.get("log_tail", []) if x.startswith("error:")), None)
    if predicted is not None and out["ok"]:
        out["predicted"] = predicted.total
        out["predicted_over_measured"] = round(predicted.total / result["peak_above_baseline"], 4)
        out["predicted_parts"] = predicted.parts
    return out


def memory(model_dir: Path, work: Path, *, batch: int, seq: int, steps: int) -> dict[str, Any]:
    """(b) and (c) for the benchmark model."""
    base = {"batch": batch, "seq": seq, "buffers": 2, "quant": "none", "dtype": "float32"}
    tame = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    arms: dict[str, Any] = {}
    for name, run, stream in (
        ("streamed_disk", {**base, "tier": "disk"}, True),
        ("streamed_ram", {**base, "tier": "ram"}, True),
        ("resident_checkpointed", {**base, "tier": "disk", "checkpointing": True}, False),
        ("resident", {**base, "tier": "disk"}, False),
    ):
        result = _soup_run(
            name, model_dir, work, run=run, stream=stream, steps=steps, env=None if stream else tame
        )
        arms[name] = _summary(result, _prediction(model_dir, run) if stream else None)
        print(
            f"  {name}: {json.dumps({k: v for k, v in arms[name].items() if k != 'predicted_parts'})}",
            flush=True,
        )

    # the calibration measures 3 steps: a longer run of the disk arm shows whether anything keeps growing
    long_ = _soup_run(
        "streamed_disk_12_steps", model_dir, work, run={**base, "tier": "disk"}, stream=True, steps=12
    )
    arms["streamed_disk_12_steps"] = {
        **_summary(long_, _prediction(model_dir, {**base, "tier": "disk"})),
        "between_steps": [s["anon"] - long_["baseline_anon"] for s in long_.get("steps", [])],
    }

    def ratio(key: str, other: str) -> float:
        return round(arms["streamed_disk"][key] / arms[other][key], 4)

    return {
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "arms": arms,
        "disk_over_resident_checkpointed": {
            "anonymous": ratio("peak_anon_above_baseline", "resident_checkpointed"),
            "resident_set": ratio("peak_rss_above_baseline", "resident_checkpointed"),
        },
        "disk_over_resident": {
            "anonymous": ratio("peak_anon_above_baseline", "resident"),
            "resident_set": ratio("peak_rss_above_baseline", "resident"),
        },
        "goal": "disk / resident <= 0.35",
        "note": "the resident arms' frozen weights are not anonymous memory: transformers maps the float32 "
        "safetensors file copy-on-write (rw-p) instead of copying it, so they are file-backed pages of the "
        "process (file_backed_at_end); the resident set (anonymous + file-backed) compares what each "
        "process holds in RAM",
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
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: speed, memory, larger")
    parser.add_argument("--work", type=Path, default=Path("/tmp/soup-bench-streaming"))
    parser.add_argument("--record", action="store_true", help=f"write the result under {RESULTS}")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    import torch

    torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    model_dir = harness.build_model(args.work / "models" / harness.model_key(BENCH), BENCH)
    params = preflight.ModelShape.from_config(json.loads((model_dir / "config.json").read_text())).params()
    result: dict[str, Any] = {
        "benchmark": "streaming",
        "device": args.device,
        "model": {**BENCH, "parameters": params},
        "note": SHARED_NOTE if args.device == "cpu" else "",
        "preflight_constants": preflight.CPU_FIT,
        **machine(),
    }
    started = time.time()
    if "speed" not in skip:
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
    if args.device == "cpu" and "memory" not in skip:
        print("(b, c) memory ...", flush=True)
        result["memory"] = memory(model_dir, args.work, batch=args.batch, seq=args.seq, steps=3)
    if args.device == "cpu" and "larger" not in skip:
        print("(b) larger than the memory allowed ...", flush=True)
        result["larger_than_memory"] = larger_than_memory(
            args.work, limit=int(args.limit_gib * 2**30), batch=1, seq=64, steps=2
        )
        print(json.dumps(result["larger_than_memory"], indent=1), flush=True)
    result["seconds"] = round(time.time() - started)
    result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.record:
        path = RESULTS / ("streaming.json" if args.device == "cpu" else "streaming_cuda.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        print(f"recorded {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
