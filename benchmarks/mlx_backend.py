"""`soup train --backend mlx` against a plain mlx-lm LoRA run with the same settings: training tokens/s.

Two arms, the same LoRA run on the same local model and rows, in this one process:

- ``soup``: ``soup train --backend mlx`` in-process (``run_train_command``: config validation, plugins
  from their entry points, data pipeline, tracker row, recorders — the rewind log too when that plugin
  is installed — and the mlx backend with its per-row statistics, events, metrics and progress);
- ``mlx_lm``: mlx-lm's own LoRA training loop (``mlx_lm.tuner.trainer.train``) on mlx-lm's own dataset
  wrapper, with ``linear_to_lora_layers`` on the same modules, AdamW with the same settings.

Same settings: LoRA r 8 (scale 2 = alpha 16 / r), dropout 0.05, the 7 projections of every layer,
batch 4, learning rate 1e-4 constant, AdamW with bias correction and no weight decay, no clipping
(soup: ``max_grad_norm: 0``), one pass over the rows. Every row encodes to exactly ``--length`` tokens in
both (checked), so both arms train on the same number of tokens per step and pad alike.

Timing: the machine is shared with other jobs whose load changes over seconds, so the two runs go in two
processes and a baton lets exactly one of them train at a time, alternating step by step: soup step 1,
mlx_lm step 1, soup step 2, ... Each arm's turn is timed from the moment it gets the baton to the moment
it hands it on at its next step: one optimizer step plus the loop code around it (batching, forward and
backward, update, logging, events, progress). Loading and set-up happen before the first turn, saving
after the last, so neither is timed; the first ``--warmup`` turns (graph compilation) are dropped.
tokens/s = supervised tokens of the timed steps / their time. A pair is one run of each arm (the arm
that starts alternates). Both arms train on the same number of tokens every step, so the speed ratio of
one step is mlx_lm's time / soup's time for it; the result is the median of those ratios over every
timed step of every pair (robust to the other jobs' bursts, which hit single turns), with each pair's
whole-run ratio reported beside it. Goal: >= 0.95.

Usage: python benchmarks/mlx_backend.py [--pairs 5] [--warmup 2] [--record]
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
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

RESULTS = _common.RESULTS / "mlx.json"
HIDDEN, LAYERS, BATCH, LENGTH, N_ROWS, LR = 64, 2, 4, 128, 64, 1e-4
WAIT_S = 900.0  # no turn lasts this long unless something is broken
PROJECTIONS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


def make_rows(tokenizer: Any, n: int, length: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` text rows that encode to exactly ``length`` tokens (eos included) for soup and mlx-lm alike."""
    from soup_core.default_plugins.sft import encode_example

    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        words = " ".join(str(rng.randint(0, 99999)) for _ in range(length))
        ids = tokenizer(words, add_special_tokens=False)["input_ids"][: length - 1]
        text = tokenizer.decode(ids)
        soup_ids, _ = encode_example({"text": text}, tokenizer, max_length=10 * length)
        mlx_ids = tokenizer.encode(text)
        if mlx_ids[-1] != tokenizer.eos_token_id:
            mlx_ids = [*mlx_ids, tokenizer.eos_token_id]
        if len(soup_ids) == length and soup_ids == mlx_ids:
            rows.append({"text": text})
    return rows


class Baton:
    """Lets exactly one of two processes train at a time, alternating step by step; times each turn.

    An arm calls :meth:`take` before each of its optimizer steps: that ends its previous turn (the step
    and the loop code after it), hands the baton over, and waits until it comes back. :meth:`finish`
    ends an arm's last turn (not timed: it includes saving) and lets the other run freely. The arms are
    separate processes, so neither shares the other's MLX allocator cache or compiled graphs.
    """

    def __init__(self, mp: Any, first: int) -> None:
        self.cond = mp.Condition()
        self.turn = mp.Value("i", first, lock=False)
        self.done = mp.Array("i", 2, lock=False)
        self.me = -1
        self.held: list[float] = []
        self._since: float | None = None

    def bind(self, me: int) -> None:
        self.me = me

    def _mine(self) -> bool:
        return self.turn.value == self.me or bool(self.done[1 - self.me])

    def take(self) -> None:
        with self.cond:
            if self._since is not None:
                self.held.append(time.perf_counter() - self._since)
                self._since = None
                if not self.done[1 - self.me]:
                    self.turn.value = 1 - self.me
                self.cond.notify_all()
            if not self.cond.wait_for(self._mine, timeout=WAIT_S):
                raise RuntimeError(f"an arm waited {WAIT_S:.0f} s for its turn")
            self._since = time.perf_counter()

    def finish(self) -> None:
        with self.cond:
            self._since = None
            self.done[self.me] = 1
            self.turn.value = 1 - self.me
            self.cond.notify_all()


def tokens_per_second(held: list[float], step_tokens: int, warmup: int) -> float:
    """Supervised tokens / seconds over the timed turns after ``warmup`` (one optimizer step each)."""
    timed = held[warmup:]
    if not timed:
        raise RuntimeError(f"too few steps to time ({len(held)} timed, warmup {warmup})")
    return step_tokens * len(timed) / sum(timed)


def soup_arm(config: Path, output: Path, baton: Baton) -> None:
    """One ``soup train --backend mlx`` run, taking the baton before every optimizer step."""
    from soup_core.default_plugins.commands.train_cmd import run_train_command
    from soup_plugin_mlx import blas

    blas.activate()  # as MLXBackend.train does: importing the trainer below imports mlx
    from soup_plugin_mlx import trainer

    original = trainer.MLXRun._optimizer_step

    def gated(self: Any, group: list[list[int]]) -> None:
        baton.take()
        original(self, group)

    trainer.MLXRun._optimizer_step = gated  # type: ignore[method-assign]
    try:
        shutil.rmtree(output, ignore_errors=True)
        code = run_train_command(config, overrides={"backend": "mlx", "output": str(output)}, dry_run=False)
    finally:
        trainer.MLXRun._optimizer_step = original  # type: ignore[method-assign]
        baton.finish()
    if code != 0:
        raise RuntimeError(f"soup train failed with exit code {code}")


def mlx_lm_arm(model_dir: Path, rows: list[dict[str, str]], work: Path, baton: Baton) -> None:
    """One plain mlx-lm LoRA run, taking the baton before every optimizer step (as its batches are drawn)."""
    from soup_plugin_mlx import blas

    blas.activate()  # the BLAS soup's arm multiplies on (before mlx loads): the comparison is of the loops
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm import load
    from mlx_lm.tuner.datasets import CacheDataset, TextDataset
    from mlx_lm.tuner.trainer import TrainingArgs, iterate_batches, train
    from mlx_lm.tuner.utils import linear_to_lora_layers

    def gated_batches(*args: Any, **kwargs: Any):
        for batch in iterate_batches(*args, **kwargs):
            baton.take()
            yield batch

    import mlx_lm.tuner.trainer as mlx_trainer

    class QuietUI(mlx_trainer.TrainUI):
        # mlx-lm's rich progress bar redraws from its own thread, which would run during soup's turns;
        # built as for a non-zero rank, it draws nothing (this only makes the mlx_lm arm cheaper)
        def __init__(self, total_iters: int, rank: int = 0) -> None:
            super().__init__(total_iters, rank=1)

    mlx_trainer.TrainUI = QuietUI
    try:
        mx.random.seed(42)
        model, wrapper = load(str(model_dir))
        model.freeze()
        linear_to_lora_layers(model, LAYERS, {"rank": 8, "scale": 2.0, "dropout": 0.05, "keys": PROJECTIONS})
        optimizer = optim.AdamW(learning_rate=LR, weight_decay=0.0, bias_correction=True)
        (work / "mlx_lm").mkdir(exist_ok=True)
        args = TrainingArgs(
            batch_size=BATCH,
            iters=len(rows) // BATCH,
            steps_per_report=10**9,
            steps_per_eval=10**9,
            steps_per_save=10**9,
            max_seq_length=LENGTH,
            adapter_file=str(work / "mlx_lm" / "adapters.safetensors"),
        )
        train(
            model,
            optimizer,
            CacheDataset(TextDataset(rows, wrapper._tokenizer)),
            None,
            args,
            iterate_batches=gated_batches,
        )
    finally:
        mlx_trainer.TrainUI = QuietUI.__bases__[0]
        baton.finish()


def _arm(name: str, me: int, baton: Baton, results: Any, args: tuple) -> None:
    """A child process: run one arm, send back its turn times (or its error)."""
    baton.bind(me)
    try:
        if name == "soup":
            soup_arm(*args, baton)
        else:
            mlx_lm_arm(*args, baton)
        results.put((name, baton.held, None))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        results.put((name, baton.held, f"{type(exc).__name__}: {exc}"))


def one_pair(
    order: tuple[str, str], config: Path, model_dir: Path, rows: list[dict[str, str]], work: Path
) -> dict[str, list[float]]:
    """Both arms in two processes, alternating step by step (``order[0]`` starts); each arm's turn times."""
    import multiprocessing

    mp = multiprocessing.get_context("spawn")
    baton = Baton(mp, first=0)
    results = mp.Queue()
    arm_args = {"soup": (config, work / "out"), "mlx_lm": (model_dir, rows, work)}
    procs = [
        mp.Process(target=_arm, args=(name, i, baton, results, arm_args[name]))
        for i, name in enumerate(order)
    ]
    for proc in procs:
        proc.start()
    held: dict[str, list[float]] = {}
    errors = []
    for _ in procs:
        name, times, error = results.get(timeout=WAIT_S)
        held[name] = times
        if error:
            errors.append(f"{name}: {error}")
    for proc in procs:
        proc.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--record", action="store_true", help=f"write the result to {RESULTS}")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="soup-bench-mlx-"))
    os.environ["SOUP_HOME"] = str(work / "home")
    try:
        from transformers import AutoTokenizer

        from soup_core.default_plugins.transformers import build_tiny_model

        model_dir = build_tiny_model(work / "model", hidden=HIDDEN, layers=LAYERS, seed=0)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        rows = make_rows(tokenizer, N_ROWS, LENGTH)
        (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        config = work / "soup.yaml"
        config.write_text(
            f"base: {model_dir}\nbackend: mlx\n"
            f"data:\n  train: data.jsonl\n  format: text\n  max_length: {LENGTH}\n"
            f"training:\n  epochs: 1\n  batch_size: {BATCH}\n  learning_rate: {LR}\n  scheduler: constant\n"
            "  max_grad_norm: 0\n  logging_steps: 1000\n  lora: {r: 8, alpha: 16, dropout: 0.05}\n",
            encoding="utf-8",
        )
        pairs: list[dict[str, float]] = []
        step_ratios: list[float] = []
        steps = N_ROWS // BATCH
        step_tokens = BATCH * (LENGTH - 1)
        for i in range(args.pairs):
            order = ("soup", "mlx_lm") if i % 2 == 0 else ("mlx_lm", "soup")
            held = one_pair(order, config, model_dir, rows, work)
            for arm in order:
                # every turn but the last (which saves) is one optimizer step of BATCH x (LENGTH - 1) targets
                assert len(held[arm]) == steps - 1, (arm, len(held[arm]))
            soup_t, mlx_t = held["soup"][args.warmup :], held["mlx_lm"][args.warmup :]
            # the same step of both arms ran back to back: its ratio of speeds is mlx_lm's time / soup's
            step_ratios += [m / s for s, m in zip(soup_t, mlx_t, strict=True)]
            speed = {arm: tokens_per_second(held[arm], step_tokens, args.warmup) for arm in order}
            speed["ratio"] = speed["soup"] / speed["mlx_lm"]
            speed["median_step_ratio"] = statistics.median(m / s for s, m in zip(soup_t, mlx_t, strict=True))
            pairs.append(speed)
            print(
                f"pair {i + 1}: soup {speed['soup']:,.0f} tok/s, mlx_lm {speed['mlx_lm']:,.0f} tok/s, "
                f"ratio {speed['ratio']:.3f}, median step ratio {speed['median_step_ratio']:.3f}",
                file=sys.stderr,
                flush=True,
            )
        import mlx.core as mx
        import mlx_lm

        result = {
            "benchmark": "soup train --backend mlx vs plain mlx_lm LoRA (tokens/s)",
            "median_ratio": round(statistics.median(step_ratios), 4),
            "goal": ">= 0.95",
            "ratio_definition": "median over every timed step of (mlx_lm step time / soup step time), the "
            "two arms' same step run back to back; tokens per step are equal",
            "median_of_pair_ratios": round(statistics.median(p["ratio"] for p in pairs), 4),
            "step_pairs": len(step_ratios),
            "pairs": [{k: round(v, 4) for k, v in p.items()} for p in pairs],
            "median_tokens_per_second": {
                arm: round(statistics.median(p[arm] for p in pairs), 1) for arm in ("soup", "mlx_lm")
            },
            "settings": {
                "hidden": HIDDEN,
                "layers": LAYERS,
                "batch": BATCH,
                "tokens_per_row": LENGTH,
                "rows": N_ROWS,
                "steps_per_run": N_ROWS // BATCH,
                "warmup_steps_dropped": args.warmup,
                "lora": "r 8, alpha 16, dropout 0.05, q/k/v/o/gate/up/down of every layer",
            },
            **_common.machine(
                device=str(mx.default_device()),
                mlx=mx.__version__,
                mlx_lm=mlx_lm.__version__,
                note="shared machine: other jobs run at the same time; compare ratios, not times",
            ),
        }
        print(json.dumps(result, indent=2))
        if args.record:
            _common.record("mlx", result)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
