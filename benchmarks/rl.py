"""Step time of ``soup train --task grpo`` against a plain trl ``GRPOTrainer`` script with the same settings.

Both run in this process, on the same tiny model, data, LoRA adapter, reward function and GRPO settings
(variant ``grpo``: trl's ``loss_type="grpo"``, std-scaled advantages, plain k3 KL, β 0.1). Runs are
interleaved in pairs (the order alternates), each pair's ratio is trl's median step time over soup's (the
first step of each run is warm-up and left out; a step is timed from its start to the next step's start, so
its logging and the callbacks of its log phase count), and the result is the median ratio over the pairs. Goal:
≥ 0.95 (soup at least 95 % of plain trl's speed). Each step is timed twice: by the wall clock and by the CPU
time of the training thread (``time.thread_time``; with one torch thread every step's work runs there). On a
machine shared with other jobs the wall clock also counts the time the step waited for a core, which differs
from run to run; the CPU ratio does not, so both are recorded. The result is written to ``results/rl.json``.

    python benchmarks/rl.py [--pairs 7] [--steps 10] [--base MODEL_DIR] [--out results/rl.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SETTINGS = {
    "batch_size": 2,  # prompts per micro-batch
    "num_generations": 4,
    "max_completion_length": 16,
    "learning_rate": 1e-4,
    "beta": 0.1,
    "seed": 42,
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,  # every rl task trains with trl's disable_dropout: soup refuses any other value
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def prompts(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"Q{i}: what is {i} plus {i}?", "answer": str(2 * i)} for i in range(n)]


def length(completions, completion_ids, **kwargs):
    return [1.0 - len(ids) / SETTINGS["max_completion_length"] for ids in completion_ids]


class StepTimer:
    """A trainer callback that keeps the wall time of every optimizer step."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            # from one step's start to the next one's: the step's logging and every callback after it (soup's
            # tracker, progress line and controllers run in the trainer's log phase, after on_step_end) count
            def on_step_begin(self, args, state, control, **kwargs):
                now, cpu = time.perf_counter(), time.thread_time()
                if timer.start is not None:
                    timer.times.append(now - timer.start)
                    timer.cpu_times.append(cpu - timer.cpu_start)
                timer.start, timer.cpu_start = now, cpu

        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.start: float | None = None
        self.cpu_start = 0.0
        self.callback = Callback()

    def median(self) -> tuple[float, float]:
        """(wall, CPU) median step time, the first step (warm-up) left out."""
        return statistics.median(self.times[1:]), statistics.median(self.cpu_times[1:])


def run_trl(base: Path, out: Path, steps: int) -> tuple[float, float]:
    """The plain trl script a user would write."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(SETTINGS["seed"])
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=SETTINGS["batch_size"] * 4,
        num_generations=SETTINGS["num_generations"],
        max_completion_length=SETTINGS["max_completion_length"],
        learning_rate=SETTINGS["learning_rate"],
        beta=SETTINGS["beta"],
        seed=SETTINGS["seed"],
        loss_type="grpo",
        scale_rewards="group",
        use_bias_correction_kl=False,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        save_strategy="no",
        disable_dropout=True,  # as soup's grpo sets it: log-probabilities must not depend on a dropout draw
    )
    peft = LoraConfig(
        r=SETTINGS["lora_r"],
        lora_alpha=SETTINGS["lora_alpha"],
        lora_dropout=SETTINGS["lora_dropout"],
        target_modules=TARGETS,
        task_type="CAUSAL_LM",
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[length],
        args=args,
        train_dataset=Dataset.from_list(prompts(64)),
        processing_class=tokenizer,
        peft_config=peft,
        callbacks=[timer.callback],
    )
    trainer.remove_callback(PrinterCallback)  # soup removes it too: printing is not what is measured
    trainer.train()
    return timer.median()


def run_soup(base: Path, folder: Path, steps: int) -> tuple[float, float]:
    """``soup train`` (the CLI's own function, in-process) with a step timer added to the built trainer."""
    import yaml

    import soup_core.plugins
    from soup_core.default_plugins.commands.train_cmd import run_train_command
    from soup_core.testing import isolated_plugins
    from soup_plugin_rl import plugin as rl
    from soup_plugin_rl.tasks import GRPOTask

    timer = StepTimer()

    class TimedGRPO(GRPOTask):
        def build(self, backend, context):
            trainer = super().build(backend, context)
            trainer.add_callback(timer.callback)
            return trainer

    class Plugin:
        SOUP_HOOK_API = rl.SOUP_HOOK_API

    for hook in (
        "soup_register_data_formats",
        "soup_register_config_fields",
        "soup_register_support",
        "soup_register_probes",
        "soup_preflight",
    ):
        setattr(Plugin, hook, staticmethod(getattr(rl, hook)))
    from soup_core import hookimpl

    Plugin.soup_register_tasks = staticmethod(hookimpl(lambda: [TimedGRPO]))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts(64)))
    config = {
        "base": str(base),
        "task": "grpo",
        "output": str(folder / "out"),
        "data": {"train": "prompts.jsonl"},
        "training": {
            "max_steps": steps,
            "batch_size": SETTINGS["batch_size"],
            "learning_rate": SETTINGS["learning_rate"],
            "seed": SETTINGS["seed"],
            "logging_steps": 1,
            "grpo_variant": "grpo",
            "reward_fn": "length",
            "num_generations": SETTINGS["num_generations"],
            "beta": SETTINGS["beta"],
            "max_completion_length": SETTINGS["max_completion_length"],
            "rewind_log": False,
            "lora": {
                "r": SETTINGS["lora_r"],
                "alpha": SETTINGS["lora_alpha"],
                "dropout": SETTINGS["lora_dropout"],
            },
        },
    }
    (folder / "soup.yaml").write_text(yaml.safe_dump(config))
    plugins = isolated_plugins(("rl", Plugin()), *_rewind())
    original = soup_core.plugins.load_plugins
    soup_core.plugins.load_plugins = lambda *a, **k: plugins
    try:
        code = run_train_command(folder / "soup.yaml", overrides={}, dry_run=False)
    finally:
        soup_core.plugins.load_plugins = original
    if code != 0:
        raise SystemExit(f"soup train failed with exit code {code}")
    return timer.median()


def _rewind() -> list[tuple[str, Any]]:
    try:
        from soup_plugin_rewind import plugin as rewind
    except ImportError:
        return []
    return [("rewind", rewind)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--base", type=Path, default=None, help="a model folder (default: the tiny model)")
    parser.add_argument("--out", type=Path, default=_common.RESULTS / "rl.json")
    opts = parser.parse_args()
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    work = Path(tempfile.mkdtemp(prefix="soup-bench-rl-"))
    os.environ.setdefault("SOUP_HOME", str(work / "home"))
    if opts.base is None:
        from soup_core.default_plugins.transformers import tiny_model_dir

        opts.base = tiny_model_dir(work / "tiny")
    pairs = []
    for i in range(opts.pairs):
        order = ("trl", "soup") if i % 2 == 0 else ("soup", "trl")
        times, cpu = {}, {}
        for who in order:
            folder = work / f"pair{i}-{who}"
            times[who], cpu[who] = (
                run_trl(opts.base, folder, opts.steps)
                if who == "trl"
                else run_soup(opts.base, folder, opts.steps)
            )
        pairs.append(
            {
                "order": list(order),
                "trl_step_s": times["trl"],
                "soup_step_s": times["soup"],
                "ratio": times["trl"] / times["soup"],
                "trl_step_cpu_s": cpu["trl"],
                "soup_step_cpu_s": cpu["soup"],
                "cpu_ratio": cpu["trl"] / cpu["soup"],
            }
        )
        print(
            f"pair {i}: trl {times['trl'] * 1e3:.1f} ms/step, soup {times['soup'] * 1e3:.1f} ms/step, "
            f"ratio {pairs[-1]['ratio']:.3f}; CPU trl {cpu['trl'] * 1e3:.1f} ms, soup {cpu['soup'] * 1e3:.1f} ms, "
            f"ratio {pairs[-1]['cpu_ratio']:.3f}",
            flush=True,
        )
    ratio = statistics.median(p["ratio"] for p in pairs)
    cpu_ratio = statistics.median(p["cpu_ratio"] for p in pairs)
    result = {
        "benchmark": "soup train --task grpo vs plain trl GRPOTrainer, step time",
        "median_ratio": ratio,
        "median_cpu_ratio": cpu_ratio,
        "goal": 0.95,
        "met": ratio >= 0.95,
        "cpu_met": cpu_ratio >= 0.95,
        "pairs": pairs,
        "settings": {**SETTINGS, "steps_per_run": opts.steps, "base": str(opts.base)},
        **_common.machine(torch=torch.__version__, device="cuda" if torch.cuda.is_available() else "cpu",
                          threads=torch.get_num_threads()),
    }
    _common.record(opts.out, result)
    verdict = "met" if result["met"] else "NOT met"
    print(f"median ratio (trl step time / soup step time): {ratio:.3f} — goal 0.95 {verdict}; "
          f"by CPU time {cpu_ratio:.3f} ({'met' if result['cpu_met'] else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
