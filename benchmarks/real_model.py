"""A real model end to end (issue 29, item 4): Soup against plain trl and against the original tool on
SmolLM2-135M, ratios in one run.

The run, the same on every side: LoRA r 8 (alpha 16, dropout 0.05) on every linear layer of the decoder,
batch 4, max_length 256, fp32, learning rate 2e-4, one epoch of 64 short chat rows (16 steps), the whole
conversation trained (trl's default for chat rows; Soup's ``data.train_on_responses_only: false``), CPU.

- ``sft``: ``soup train`` against a plain trl ``SFTTrainer`` script in the same environment. Each is a process
  of its own run through a small wrapper that times ``Trainer.train`` (wall and process CPU) and reports the
  process's peak resident memory (``ru_maxrss``) at exit. Both train the same rows once, so the same tokens:
  tokens/s of Soup over trl is trl's training time over Soup's (goal >= 1.0); peak resident memory of Soup
  over trl (goal <= 1.0, and <= 0.75). The trl script sets ``bf16=False``: trl's ``SFTConfig`` defaults to bf16
  autocast even on a CPU (much faster on one with AMX), and the recipe is fp32 on both sides.
- ``original``: the whole ``soup train`` (start-up, loading, data, training, saving) against the original tool,
  soup-cli 0.77.0 in its own environment, given the same model folder, rows and recipe (goal <= 0.85x wall).
  Timed as whole processes (``_common.timed_process``), no wrapper. Until 2026-12-07 this part gave each tool
  its own defaults, and the original's LoRA covers q_proj and v_proj only (2 adapters a layer against 7).

The sides alternate which goes first (``_common.interleaved_pairs``); each result is the median of the pair
ratios. The model is a local folder given as the argument (a dequantised SmolLM2-135M-Instruct); nothing is
downloaded. The original's environment (see startup.py):

    python -m venv --without-pip /tmp/soupcli077
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/soupcli077/lib/python3.11/site-packages/zz.pth
    /tmp/soupcli077/bin/python -m pip install "soup-cli[train]==0.77.0"

Usage: python benchmarks/real_model.py MODEL_DIR [--pairs 2] [--only sft,original] [--original PY] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import _common

RESULTS = _common.RESULTS / "real_model.json"
ROWS, BATCH, MAX_LENGTH, LR = 64, 4, 256, 2e-4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: Runs a script or module with ``Trainer.train`` timed and the peak resident memory printed at exit.
WRAPPER = '''
import atexit, importlib.abc, importlib.util, resource, runpy, sys, time
def patch(tt):
    _train = tt.Trainer.train
    def train(self, *a, **k):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return _train(self, *a, **k)
        finally:
            print(f"BENCH_TRAIN {time.perf_counter() - wall:.3f} {time.process_time() - cpu:.3f} "
                  f"{self.state.global_step}", flush=True)
    tt.Trainer.train = train
class Patcher(importlib.abc.MetaPathFinder):  # patched when the tool imports it: importing transformers.trainer
    def find_spec(self, name, path=None, target=None):  # here would import peft, and so bitsandbytes, for both
        if name != "transformers.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            patch(module)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Patcher())
atexit.register(lambda: print(f"BENCH_PEAK_KB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True))
target = sys.argv[1]
sys.argv = [target] + sys.argv[2:]
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
'''

PLAIN_TRL = f'''
import json, sys, torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer
model_dir, data, out = sys.argv[1:4]
rows = [json.loads(line) for line in open(data, encoding="utf-8")]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
args = SFTConfig(output_dir=out, num_train_epochs=1, learning_rate={LR}, per_device_train_batch_size={BATCH},
                 gradient_accumulation_steps=1, use_cpu=True, report_to="none", disable_tqdm=True, seed=42,
                 bf16=False, fp16=False,  # trl's default is bf16 autocast, on a CPU too; the recipe is fp32
                 save_strategy="no", eval_strategy="no", max_length={MAX_LENGTH}, logging_steps=8,
                 gradient_checkpointing=False, activation_checkpointing=False, dataloader_num_workers=0)
trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                     peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules={TARGETS!r},
                                            task_type="CAUSAL_LM"))
trainer.train()
trainer.save_model(out)
print("plain trl done", trainer.state.global_step)
'''


def make_rows(path: Path) -> Path:
    """64 short chat rows (about 40 tokens each with SmolLM2's template)."""
    rng = random.Random(0)
    topics = ["the sea", "mountains", "bread", "a small robot", "rain", "music", "trains", "a garden"]
    rows = []
    for i in range(ROWS):
        topic = rng.choice(topics)
        rows.append({"messages": [
            {"role": "user", "content": f"Tell me one short fact about {topic} ({i})."},
            {"role": "assistant", "content": f"Here is a short fact about {topic}: it is number {i} in my list."},
        ]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def soup_config(path: Path, model: str, rows: Path, output: Path, *, original: bool = False) -> Path:
    """The same run as a Soup config; ``original``: as soup-cli 0.77.0 spells it (``lr``; its dtype on a CPU is
    float32 already). Every LoRA key is written out: the original's defaults differ (q_proj and v_proj only)."""
    lr = f"  lr: {LR}\n" if original else f"  learning_rate: {LR}\n  dtype: float32\n"
    path.write_text(
        f"base: {model}\ndata:\n  train: {rows}\n  val_split: 0.0\n  max_length: {MAX_LENGTH}\n"
        f"  train_on_responses_only: false\ntraining:\n  epochs: 1\n  batch_size: {BATCH}\n"
        f"  gradient_accumulation_steps: 1\n  quantization: none\n{lr}"
        f"  lora:\n    r: 8\n    alpha: 16\n    dropout: 0.05\n    target_modules: [{', '.join(TARGETS)}]\n"
        f"output: {output}\n", encoding="utf-8")
    return path


def wrapped(cmd: list[str], env: dict[str, str], cwd: Path, expect: str) -> dict[str, float]:
    """One wrapped run: training wall and CPU seconds, steps, peak resident MB, whole-process wall and CPU."""
    import subprocess
    import time

    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    if out.returncode != 0 or expect not in out.stdout or "BENCH_TRAIN" not in out.stdout:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stdout[-3000:]}")
    got: dict[str, float] = {"process_wall_s": round(wall, 2)}
    for line in out.stdout.splitlines():
        if line.startswith("BENCH_TRAIN "):
            train_wall, train_cpu, steps = line.split()[1:]
            got.update(train_wall_s=float(train_wall), train_cpu_s=float(train_cpu), steps=int(steps))
        elif line.startswith("BENCH_PEAK_KB "):
            got["peak_mb"] = round(int(line.split()[1]) / 1024, 1)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a transformers model folder (SmolLM2-135M-Instruct, dequantised)")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--only", default="sft,original")
    parser.add_argument("--original", default="/tmp/soupcli077/bin/python",
                        help="a Python with soup-cli[train]==0.77.0 installed")
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS}")
    args = parser.parse_args()
    model = str(Path(args.model).resolve())
    work = Path(tempfile.mkdtemp(prefix="soup-real-"))
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "SOUP_HOME": str(work / "home"),
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    rows = make_rows(work / "rows.jsonl")
    (work / "wrapper.py").write_text(WRAPPER, encoding="utf-8")
    (work / "plain_trl.py").write_text(PLAIN_TRL, encoding="utf-8")
    wrap = [sys.executable, str(work / "wrapper.py")]
    only = set(args.only.split(","))
    result: dict[str, object] = {"benchmark": "real_model", "model": model, "load_before": _common.load_average()}

    def clear_soup() -> None:  # prepared data re-encoded every run, as the other side tokenises every run
        shutil.rmtree(work / "home" / "cache" / "data", ignore_errors=True)

    if "sft" in only:
        cfg = soup_config(work / "soup.yaml", model, rows, work / "out-soup")

        def soup() -> dict[str, float]:
            clear_soup()
            return wrapped(wrap + ["soup_core", "train", "-c", str(cfg), "--overwrite"], env, work, "Done.")

        def trl() -> dict[str, float]:
            return wrapped(wrap + [str(work / "plain_trl.py"), model, str(rows), str(work / "out-trl")], env, work,
                           "plain trl done")

        def show(i: int, got: dict[str, list[dict[str, float]]]) -> None:
            _common.say(f"  sft pair {i + 1}: soup {got['soup'][-1]}, trl {got['trl'][-1]}")

        got = _common.interleaved_pairs({"soup": soup, "trl": trl}, args.pairs, show)
        def of(side: str, key: str) -> list[float]:
            return [run[key] for run in got[side]]

        speed = _common.median_ratio(of("trl", "train_wall_s"), of("soup", "train_wall_s"))
        speed_cpu = _common.median_ratio(of("trl", "train_cpu_s"), of("soup", "train_cpu_s"))
        memory = _common.median_ratio(of("soup", "peak_mb"), of("trl", "peak_mb"))
        result["sft"] = {
            "what": f"soup train vs a plain trl SFTTrainer script, {ROWS} chat rows, 16 steps, batch {BATCH}, "
                    f"max_length {MAX_LENGTH}, LoRA r 8 on every linear layer, fp32, whole conversation trained",
            "pairs": args.pairs,
            "tokens_per_s_ratio": round(speed[0], 3), "tokens_per_s_ratios": [round(r, 3) for r in speed[1]],
            "tokens_per_cpu_s_ratio": round(speed_cpu[0], 3),
            "tokens_per_cpu_s_ratios": [round(r, 3) for r in speed_cpu[1]],
            "peak_rss_ratio": round(memory[0], 3), "peak_rss_ratios": [round(r, 3) for r in memory[1]],
            "soup": got["soup"], "trl": got["trl"],
            "goal": "tokens/s >= 1.0; peak resident memory <= 1.0 and <= 0.75",
        }
    if "original" in only:
        ours = soup_config(work / "whole.yaml", model, rows, work / "out-whole")
        theirs = soup_config(work / "whole-original.yaml", model, rows, work / "out-original", original=True)
        original_env = {**env, "SOUP_HOME": str(work / "home-original"), "HOME": str(work / "home-original")}
        original_env.pop("PYTHONPATH")

        def soup_whole() -> tuple[float, float]:
            clear_soup()
            return _common.timed_process([sys.executable, "-m", "soup_core", "train", "-c", str(ours), "--overwrite"],
                                         env, expect="Done.", cwd=str(work))

        def original() -> tuple[float, float]:
            shutil.rmtree(work / "out-original", ignore_errors=True)
            return _common.timed_process([args.original, "-m", "soup_cli", "train", "-c", str(theirs), "--yes"],
                                         original_env, expect="Training Complete", cwd=str(work))

        def show_whole(i: int, got: dict[str, list[tuple[float, float]]]) -> None:
            _common.say(f"  whole pair {i + 1}: soup {got['soup'][-1]}, original {got['original'][-1]}")

        got_whole = _common.interleaved_pairs({"soup": soup_whole, "original": original}, args.pairs, show_whole)
        wall = _common.median_ratio([s[0] for s in got_whole["soup"]], [o[0] for o in got_whole["original"]])
        cpu = _common.median_ratio([s[1] for s in got_whole["soup"]], [o[1] for o in got_whole["original"]])
        result["original"] = {
            "what": "the whole soup train vs soup-cli 0.77.0 in its own environment, the same model folder, rows "
                    "and recipe as the sft part (LoRA r 8 on every linear layer, the whole conversation trained)",
            "pairs": args.pairs,
            "wall_ratio": round(wall[0], 3), "wall_ratios": [round(r, 3) for r in wall[1]],
            "cpu_ratio": round(cpu[0], 3), "cpu_ratios": [round(r, 3) for r in cpu[1]],
            "soup_s": [[round(x, 2) for x in s] for s in got_whole["soup"]],
            "original_s": [[round(x, 2) for x in o] for o in got_whole["original"]],
            "median_soup_wall_s": round(statistics.median(s[0] for s in got_whole["soup"]), 2),
            "goal": "wall <= 0.85",
        }
    result.update(_common.machine())
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.record:  # a run of some parts (--only) replaces those parts and keeps the others
        _common.record(RESULTS, result, merge=lambda old: {**(old if isinstance(old, dict) else {}), **result})


if __name__ == "__main__":
    main()
