"""Unlearning on the real model (issue 34, unlearn): SmolLM2-135M-Instruct forgets capitals it knew.

The facts: 40 countries' capitals. The base's greedy answer (48 new tokens, as ``soup eval --facts`` answers) to
"What is the capital of X?" is checked first; only the capitals it states are used (it must know a fact to forget
it). They are split in a fixed order: every third known fact to forget, the rest to keep. The unlearn runs train on
chat rows "What is the capital of X?" -> "The capital of X is Y." (``data.forget`` and ``data.retain``), each
method (npo, simnpo, rmu) at the settings of the plugin's demo (60 steps, learning rate 3e-3, batch 4; LoRA r 8 for
npo and simnpo, rmu on its MLPs), and nothing else set.

Measured with ``soup eval --facts`` on phrasings no run trained on ("Which city is the capital of X?" and "Name
the capital city of X."): of the questions the base itself answers right on those phrasings, the share still
answered right, for the forget facts (goal <= 10%) and the retain facts (goal >= 90%); the plain shares beside.
The control: the base's own shares on the same questions (it must state most of them, else the measure would not
see forgetting).

Usage: python benchmarks/real/unlearn.py [--only npo,simnpo,rmu] [--record]   (about 10 minutes on 2 CPUs; offline)
       python benchmarks/real/unlearn.py --smoke   (the same code path on the small pretrained model, 2 steps; CI)
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

RESULTS = _common.RESULTS / "real_unlearn.json"
CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Russia": "Moscow",
    "China": "Beijing", "Egypt": "Cairo", "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin",
    "Austria": "Vienna", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "Poland": "Warsaw", "Hungary": "Budapest", "Thailand": "Bangkok", "South Korea": "Seoul", "Kenya": "Nairobi",
    "Argentina": "Buenos Aires", "Peru": "Lima", "Chile": "Santiago", "Cuba": "Havana", "Mexico": "Mexico City",
    "Canada": "Ottawa", "Australia": "Canberra", "India": "New Delhi", "Turkey": "Ankara", "Iran": "Tehran",
    "Iraq": "Baghdad", "Belgium": "Brussels", "Netherlands": "Amsterdam", "Switzerland": "Bern",
    "Czech Republic": "Prague", "Romania": "Bucharest", "Ukraine": "Kyiv", "Vietnam": "Hanoi", "Indonesia": "Jakarta",
}
HELD_PHRASINGS = ["Which city is the capital of {c}?", "Name the capital city of {c}."]
METHODS = {"npo": "  unlearn_method: npo\n", "simnpo": "  unlearn_method: simnpo\n", "rmu": "  unlearn_method: rmu\n"}


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


_BASE: list = []


def stated(target: str, facts: Path, env: dict[str, str], cwd: Path, name: str) -> list[bool]:
    """Whether each question's greedy answer states its fact: ``soup eval --facts`` for a run's output; for the
    base (no run, so ``soup eval`` refuses it) the same greedy answers and rule in this process."""
    if name.startswith("base"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from soup_core.default_plugins.transformers import greedy_answers

        if not _BASE:
            _BASE.extend([AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval(),
                          AutoTokenizer.from_pretrained(target)])
        rows = [json.loads(line) for line in facts.read_text(encoding="utf-8").splitlines()]
        answers = greedy_answers(_BASE[0], _BASE[1], [r["prompt"] for r in rows])
        return [r["fact"].lower() in a.lower() for r, a in zip(rows, answers, strict=True)]
    out = cwd / f"answers-{name}.json"
    _common.soup("eval", target, "--facts", str(facts), "--json", str(out), env=env, cwd=cwd)
    [result] = json.loads(out.read_text())["targets"]
    return [bool(r["hit"]) for r in result["results"]]


def share(hits: list[bool]) -> float:
    return round(sum(hits) / max(1, len(hits)), 4)


def measure(base: str, work: Path, env: dict[str, str], methods: list[str], *, steps: int = 60,
            smoke: bool = False) -> dict:
    """The capitals test on ``base`` (a model folder): which capitals it states, each method's run at the demo's
    settings (``steps`` of them) and the recall of both sets on the held-out phrasings. ``smoke`` keeps every
    capital (a small model knows none) and the first six of them, so the code path runs on any model."""
    countries = list(CAPITALS)[:6] if smoke else list(CAPITALS)
    asked = write(work / "asked.jsonl", [{"prompt": f"What is the capital of {c}?", "fact": CAPITALS[c]}
                                         for c in countries])
    _common.say("the base answers the capitals ...")
    base_hits = stated(base, asked, env, work, "base-asked")
    known = countries if smoke else [c for c, hit in zip(countries, base_hits, strict=True) if hit]
    forget, retain = known[::3], [c for i, c in enumerate(known) if i % 3]

    def chat(cs: list[str]) -> list[dict]:
        return [{"messages": [{"role": "user", "content": f"What is the capital of {c}?"},
                              {"role": "assistant", "content": f"The capital of {c} is {CAPITALS[c]}."}]} for c in cs]

    def held(cs: list[str]) -> list[dict]:
        return [{"prompt": p.format(c=c), "fact": CAPITALS[c]} for c in cs for p in HELD_PHRASINGS]

    write(work / "forget.jsonl", chat(forget))
    write(work / "retain.jsonl", chat(retain))
    forget_q, retain_q = write(work / "forget_q.jsonl", held(forget)), write(work / "retain_q.jsonl", held(retain))
    result: dict = {"known": sum(base_hits), "of": len(countries), "forget": forget, "retain": retain,
                    "methods": {}}
    base_f, base_r = stated(base, forget_q, env, work, "base-f"), stated(base, retain_q, env, work, "base-r")
    result["base"] = {"forget_recall": share(base_f), "retain_recall": share(base_r)}

    def kept(hits: list[bool], before: list[bool]) -> float:  # of the questions the base answered right
        return share([h for h, b in zip(hits, before, strict=True) if b])
    _common.say(f"base: {result['base']} ({sum(base_hits)} of {len(countries)} capitals known)")
    for method in methods:
        out = work / f"out-{method}"
        lora = "" if method == "rmu" else "  lora:\n    r: 8\n    alpha: 16\n    dropout: 0.0\n"
        (work / f"{method}.yaml").write_text(
            f"base: {base}\ntask: unlearn\noutput: {out}\ndata:\n  forget: forget.jsonl\n  retain: retain.jsonl\n"
            f"  max_length: 64\ntraining:\n{METHODS[method]}  learning_rate: 0.003\n  batch_size: 4\n"
            f"  max_steps: {steps}\n  logging_steps: 10\n  dtype: float32\n{lora}", encoding="utf-8")
        _common.say(f"soup train ({method}) ...")
        _common.soup("train", "-c", str(work / f"{method}.yaml"), env=env, cwd=work)
        hits_f, hits_r = stated(str(out), forget_q, env, work, f"{method}-f"), stated(str(out), retain_q, env, work,
                                                                                     f"{method}-r")
        got = {"forget_recall": share(hits_f), "retain_recall": share(hits_r),
               "forget_kept_of_base": kept(hits_f, base_f), "retain_kept_of_base": kept(hits_r, base_r)}
        got["goal_met"] = got["forget_kept_of_base"] <= 0.10 and got["retain_kept_of_base"] >= 0.90
        params = json.loads((out / "unlearn_eval.json").read_text(encoding="utf-8"))["params"]
        got["settings"] = {k: v for k, v in params.items() if k != "method"}  # the defaults as the run resolved them
        result["methods"][method] = got
        _common.say(f"{method}: {got}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(METHODS))
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="the same code path on the small pretrained model, 2 steps, 6 capitals (no --record)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="soup-unlearn-"))
    env = {**os.environ, "SOUP_HOME": os.environ.get("SOUP_HOME", str(work / "home"))}
    os.environ["SOUP_HOME"] = env["SOUP_HOME"]
    if args.smoke:
        from soup_core.default_plugins.transformers.tiny_pretrained import tiny_pretrained_dir

        base, name = str(tiny_pretrained_dir()), "tiny-pretrained (smoke)"
    else:
        base, name = _common.real_folder()
    result = {"benchmark": "real_unlearn", "model": name,
              **measure(base, work, env, args.only.split(","), steps=2 if args.smoke else 60, smoke=args.smoke)}
    result.update(_common.machine())
    print(json.dumps(result, indent=2))
    if args.record and not args.smoke:
        _common.record(RESULTS, result)


if __name__ == "__main__":
    main()
