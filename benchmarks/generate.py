"""`soup generate` over 256 prompts against a plain batched transformers script with the same settings.

Both arms generate from the same trained LoRA adapter (a short soup run of a tiny local Llama, trained gently
so that its rows run to ``--max-new-tokens`` rather than stop after a few tokens), for the same 256 chat
prompts, greedy, ``--max-new-tokens`` tokens, batches of ``--batch`` with left padding:

- ``soup``: what ``soup generate OUT --input prompts.jsonl --output preds.jsonl`` runs once its model is
  loaded: the rows read in any training format, the prompt side rendered by the run's chat template, batched
  generation, decoding, the JSON Lines written (``soup_plugin_eval.cli.complete`` and ``predictions``);
- ``plain``: the script a user would write: ``apply_chat_template`` over the prompts, the tokenizer pads the
  batch, ``model.generate``, each row decoded, JSON Lines written.

Loading is excluded on both sides: each arm loads its model (the base with the PeftModel adapter) once,
before any timing. The machine is shared with other jobs whose load changes over seconds, so the arms take
turns: a round goes through the 256 prompts ``--per-turn`` (32) at a time, and each arm runs the same 32
back to back (soup's whole pipeline on a 32-row file, then plain's, or the other way: the order alternates).
A pair's ratio is plain's time / soup's time, its throughput ratio; the result is the median over every pair
of every round, with each round's whole-run ratio beside it, and the same median in CPU time of the thread.
Both arms must produce the same tokens (checked), so they do the same work. Goal: >= 0.9.

Usage: python benchmarks/generate.py [--rounds 5] [--prompts 256] [--batch 32] [--max-new-tokens 32] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = _common.RESULTS / "generate.json"
HIDDEN, LAYERS = 128, 4


def train(work: Path) -> tuple[Path, Path]:
    """A short LoRA run of soup train (in this process); returns its output folder and the base's."""
    from soup_core.default_plugins.transformers import build_tiny_model
    from soup_core.testing import train_in_process, write_jsonl

    model_dir = build_tiny_model(work / "model", hidden=HIDDEN, layers=LAYERS, seed=0)
    rows = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(32)]
    data = write_jsonl(work / "train.jsonl", rows)
    run = train_in_process({"base": str(model_dir), "data": {"train": str(data), "max_length": 64},
                            "training": {"max_steps": 4, "batch_size": 8, "learning_rate": 1e-4}},
                           workdir=work / "runs")
    return run.output_dir, Path(model_dir)


def prompt_files(work: Path, n: int, per_file: int) -> list[Path]:
    """``n`` chat rows of varied length (so batches are padded), whose prompt side is generated from, in files
    of ``per_file`` rows: the unit each arm runs on its turn."""
    rows = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}?" + " please" * (i % 7)},
                          {"role": "assistant", "content": "unused"}]} for i in range(n)]
    paths = []
    for k, start in enumerate(range(0, n, per_file)):
        path = work / f"prompts-{k}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[start:start + per_file]), encoding="utf-8")
        paths.append(path)
    return paths


def soup_arm(out: Path, preds: Path, args: argparse.Namespace) -> Any:
    from soup_core import atomic_write, load_plugins
    from soup_plugin_eval.cli import complete, predictions
    from soup_plugin_eval.model import Sampling, load
    from soup_plugin_eval.prompts import read_rows
    from soup_plugin_eval.target import resolve

    plugins = load_plugins()
    target = resolve(str(out), plugins=plugins)
    loaded = load(target)
    sampling = Sampling(max_new_tokens=args.max_new_tokens)

    def run(data: Path) -> list[list[int]]:
        rows, _ = read_rows(data, plugins)
        done = complete(loaded, target, rows=rows, typed=[], system=None, sampling=sampling,
                        batch_size=args.batch)
        atomic_write(preds, predictions(done))
        return [ids for _, ids, _ in done]

    return run


def plain_arm(out: Path, base: str, preds: Path, args: argparse.Namespace) -> Any:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out, padding_side="left")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), out).eval()
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])

    def run(data: Path) -> list[list[int]]:
        rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
        texts = [tokenizer.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True)
                 for r in rows]
        kept: list[list[int]] = []
        lines = []
        for start in range(0, len(texts), args.batch):
            batch = tokenizer(texts[start:start + args.batch], return_tensors="pt", padding=True,
                              add_special_tokens=False)
            with torch.inference_mode():
                generated = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False,
                                           pad_token_id=tokenizer.pad_token_id)
            new = generated[:, batch["input_ids"].shape[1]:].tolist()
            for i, row in enumerate(new):
                ids = []
                for token in row:
                    ids.append(token)
                    if token in stops:
                        break
                kept.append(ids)
                text = tokenizer.decode(ids, skip_special_tokens=True)
                lines.append(json.dumps({"index": start + i, "completion": text}))
        preds.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return kept

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--per-turn", type=int, default=32, help="prompts an arm runs on each turn")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--record", action="store_true", help=f"write the result to {RESULTS}")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="soup-bench-generate-"))
    os.environ["SOUP_HOME"] = str(work / "home")
    try:
        out, base = train(work)
        files = prompt_files(work, args.prompts, args.per_turn)
        arms = {"soup": soup_arm(out, work / "soup.jsonl", args),
                "plain": plain_arm(out, str(base), work / "plain.jsonl", args)}
        for arm in arms.values():
            arm(files[0])  # warm-up: first calls pay one-off costs
        ratios, cpu_ratios, totals = [], [], {"soup": [], "plain": []}
        generated = 0
        for i in range(args.rounds):
            spent = {"soup": 0.0, "plain": 0.0}
            for k, path in enumerate(files):
                order = ("soup", "plain") if (i + k) % 2 == 0 else ("plain", "soup")
                took, cpu, tokens = {}, {}, {}
                for arm in order:
                    started, started_cpu = time.perf_counter(), time.thread_time()
                    tokens[arm] = arms[arm](path)
                    took[arm] = time.perf_counter() - started
                    cpu[arm] = time.thread_time() - started_cpu
                    spent[arm] += took[arm]
                if tokens["soup"] != tokens["plain"]:
                    raise SystemExit("the arms generated different tokens: they are not doing the same work")
                generated += sum(len(ids) for ids in tokens["soup"]) if i == 0 else 0
                ratios.append(took["plain"] / took["soup"])
                cpu_ratios.append(cpu["plain"] / cpu["soup"])
            for arm in arms:
                totals[arm].append(spent[arm])
            print(f"round {i + 1}: soup {spent['soup']:.2f} s, plain {spent['plain']:.2f} s over {args.prompts} "
                  f"prompts; whole-round ratio {spent['plain'] / spent['soup']:.3f}", file=sys.stderr, flush=True)
        import transformers

        result = {
            "benchmark": "soup generate vs a plain batched transformers script (throughput, load excluded)",
            "median_ratio": round(statistics.median(ratios), 4),
            "goal": ">= 0.9",
            "ratio_definition": f"plain's time / soup's time for the same {args.per_turn} prompts run back to back "
                                "(which arm goes first alternates); median over every such pair of every round",
            "pairs": len(ratios),
            "median_cpu_ratio": round(statistics.median(cpu_ratios), 4),
            "cpu_ratio_definition": "the same, with the CPU time of this thread (torch runs on it, one thread), "
                                    "which other jobs on the machine disturb much less than wall-clock time",
            "quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)],
            "whole_round_ratios": [round(p / s, 4) for s, p in zip(totals["soup"], totals["plain"], strict=True)],
            "median_round_seconds": {arm: round(statistics.median(t), 3) for arm, t in totals.items()},
            "generated_tokens_per_round": generated,
            "settings": {"prompts": args.prompts, "batch": args.batch, "max_new_tokens": args.max_new_tokens,
                         "greedy": True, "padding": "left", "model": f"tiny llama hidden {HIDDEN}, {LAYERS} layers, "
                         "LoRA r 8 adapter", "rounds": args.rounds, "prompts_per_turn": args.per_turn},
            **_common.machine(torch=torch.__version__, transformers=transformers.__version__,
                              threads=torch.get_num_threads(),
                              note="shared machine: other jobs run at the same time; compare ratios, not times"),
        }
        print(json.dumps(result, indent=2))
        if args.record:
            _common.record("generate", result)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
