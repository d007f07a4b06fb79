"""CUDA bit-exactness check for soup-plugin-streaming: one script, one PASS/FAIL line per check.

Run on a machine with a GPU (about a minute; nothing is downloaded):

    PYTHONPATH=.:soup_plugin_streaming/src python soup_plugin_streaming/tests/cuda_check.py

``--device cpu --quick`` runs the small cases on the CPU (a smoke test of this script). Exit status 0 iff
every check passed. For each case, streamed vs resident with the same numerics, by ``torch.equal``: the logits
(with and without gradients), every LoRA gradient after a backward (lora_B randomised first), a 5-step
loss curve with LoRA dropout, and the same seed twice. NF4 cases also check that no call reached
bitsandbytes' 4-bit matmul. The last case is large enough that copies on the side stream overlap compute.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before torch loads
HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1] / "src")]

import torch  # noqa: E402

# name: (arch, layers, hidden, intermediate, tied, dtype, quant, double_quant, tier, buffers, pin, rows, seq)
CASES = {
    "llama fp32 ram pinned 2 buffers": (
        "llama",
        3,
        64,
        128,
        False,
        "float32",
        "none",
        True,
        "ram",
        2,
        "auto",
        2,
        64,
    ),
    "qwen2 bf16 disk 3 buffers": (
        "qwen2",
        3,
        64,
        128,
        False,
        "bfloat16",
        "none",
        True,
        "disk",
        3,
        "auto",
        2,
        64,
    ),
    "mistral bf16 ram pageable 2 buffers": (
        "mistral",
        3,
        64,
        128,
        False,
        "bfloat16",
        "none",
        True,
        "ram",
        2,
        False,
        2,
        64,
    ),
    "tied llama fp32 disk pageable": (
        "llama",
        2,
        64,
        128,
        True,
        "float32",
        "none",
        True,
        "disk",
        2,
        False,
        2,
        64,
    ),
    "llama nf4+dq bf16 ram 2 buffers": (
        "llama",
        3,
        128,
        256,
        False,
        "bfloat16",
        "nf4",
        True,
        "ram",
        2,
        "auto",
        2,
        128,
    ),
    "qwen2 nf4 fp32 disk 3 buffers": (
        "qwen2",
        3,
        128,
        256,
        False,
        "float32",
        "nf4",
        False,
        "disk",
        3,
        "auto",
        2,
        128,
    ),
    "large llama bf16 ram (overlap)": (
        "llama",
        8,
        1024,
        2816,
        False,
        "bfloat16",
        "none",
        True,
        "ram",
        2,
        "auto",
        4,
        512,
    ),
    "large llama nf4 disk (overlap)": (
        "llama",
        8,
        1024,
        2816,
        False,
        "bfloat16",
        "nf4",
        True,
        "disk",
        2,
        "auto",
        4,
        512,
    ),
}


class Counter:
    """Counts calls into bitsandbytes' 4-bit matmul while installed."""

    def __enter__(self):
        import bitsandbytes
        from bitsandbytes.autograd._functions import MatMul4Bit

        self.calls = 0
        self._saved = (bitsandbytes.matmul_4bit, MatMul4Bit.apply)

        def count(original):
            def wrapper(*args, **kwargs):
                self.calls += 1
                return original(*args, **kwargs)

            return wrapper

        bitsandbytes.matmul_4bit = count(self._saved[0])
        MatMul4Bit.apply = count(self._saved[1])
        return self

    def __exit__(self, *exc):
        import bitsandbytes
        from bitsandbytes.autograd._functions import MatMul4Bit

        bitsandbytes.matmul_4bit, MatMul4Bit.apply = self._saved


def run_case(name: str, spec: tuple, work: Path, device: str) -> list[tuple[str, bool, str]]:
    from soup_plugin_streaming import testing

    arch, layers, hidden, inter, tied, dtype, quant, dq, tier, buffers, pin, rows, seq = spec
    dtype = getattr(torch, dtype)
    model_dir = work / name.replace(" ", "_").replace("+", "")
    if not model_dir.exists():
        testing.build_tiny_checkpoint(
            model_dir,
            arch,
            layers=layers,
            hidden=hidden,
            intermediate=inter,
            tied=tied,
            vocab=512,
            seed=len(name),
        )
    lora = testing.lora_kwargs(r=8, alpha=16, dropout=0.1)
    common = dict(dtype=dtype, quant=quant, double_quant=dq, device=device)
    results = []
    s, runtime = testing.streamed(
        model_dir, work / "stores", tier=tier, buffers=buffers, pin=pin, lora=lora, seed=5, **common
    )
    r = testing.resident(model_dir, lora=lora, seed=5, **common)
    init = testing.lora_params(s), testing.lora_params(r)
    results.append(("adapter init equal", all(torch.equal(init[0][k], init[1][k]) for k in init[0]), ""))
    testing.randomize_lora_b([s, r])
    ids = testing.batch(512, rows=rows, seq=seq, device=device)
    s.eval(), r.eval()  # no dropout for the single-pass comparisons
    with torch.no_grad():
        results.append(
            ("logits (no grad)", torch.equal(s(input_ids=ids).logits, r(input_ids=ids).logits), "")
        )
    with Counter() as counter:
        out_s = s(input_ids=ids, labels=ids)
        out_s.loss.backward()
    out_r = r(input_ids=ids, labels=ids)
    out_r.loss.backward()
    torch.cuda.synchronize() if device.startswith("cuda") else None
    results.append(("logits (training forward)", torch.equal(out_s.logits, out_r.logits), ""))
    compared, differing = testing.compare_grads(s, r)
    results.append(
        (f"every LoRA gradient ({compared})", not differing, f"{len(differing)} differ: {differing[:3]}")
    )
    if quant == "nf4":
        results.append(
            ("no call reached bitsandbytes' 4-bit matmul", counter.calls == 0, f"{counter.calls} calls")
        )
    batches = [testing.batch(512, rows=rows, seq=seq, seed=i, device=device) for i in range(5)]
    again, _ = testing.streamed(
        model_dir, work / "stores", tier=tier, buffers=buffers, pin=pin, lora=lora, seed=5, **common
    )
    testing.randomize_lora_b([again])
    curves = []
    for model in (r, s, again):
        torch.manual_seed(0)
        if device.startswith("cuda"):
            torch.cuda.manual_seed_all(0)
        curves.append(testing.loss_curve(model, batches, lr=1e-3))
    results.append(("5-step loss curve", curves[1] == curves[0], f"{curves[1]} vs {curves[0]}"))
    results.append(("same seed twice", curves[2] == curves[1], f"{curves[2]} vs {curves[1]}"))
    stats = runtime.stats()
    results.append(
        (f"pool stats {stats['loads']} loads, {stats['hits']} hits, tier {stats['tier']}", True, "")
    )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    parser.add_argument("--only", default="", help="run only cases whose name contains this text")
    parser.add_argument("--quick", action="store_true", help="skip the two large cases")
    args = parser.parse_args()
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("FAIL: no CUDA device (use --device cpu for a smoke run)")
        return 1
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(
        f"device {args.device}: {torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}, "
        f"torch {torch.__version__}"
    )
    failed = total = 0
    with tempfile.TemporaryDirectory(prefix="soup-cuda-check-") as tmp:
        os.environ["SOUP_HOME"] = tmp
        for name, spec in CASES.items():
            if (args.only and args.only not in name) or (args.quick and name.startswith("large")):
                continue
            start = time.perf_counter()
            try:
                results = run_case(name, spec, Path(tmp), args.device)
            except Exception as exc:  # noqa: BLE001 - a crash is a failed case, reported with its traceback
                traceback.print_exc()
                results = [("ran", False, f"{type(exc).__name__}: {exc}")]
            for check, ok, detail in results:
                total += 1
                failed += not ok
                print(
                    f"{'PASS' if ok else 'FAIL'}  {name}: {check}"
                    + ("" if ok or not detail else f" — {detail}")
                )
            print(f"      ({time.perf_counter() - start:.1f} s)", flush=True)
    print(
        f"\n{'ALL ' + str(total) + ' CHECKS PASSED' if not failed else f'{failed} OF {total} CHECKS FAILED'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
