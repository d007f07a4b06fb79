"""Preference training on the real model (issue 34, dpo): SmolLM2-135M-Instruct learns to open its answers with a
fixed marker, from pairs that differ only in that marker.

The preference: for each question a short, correct one-sentence answer written here; the chosen completion is that
answer behind the marker ``In short:``, the rejected one is the same answer without it, so the pairs teach a style
and nothing else. The base never opens an answer that way (its share is the control: the measure can fail, and
does on the base). Prompts are the base's chat template around one user turn (the rendering ``soup eval --facts``
uses), so the runs train on the very prompts the model is asked. 40 training questions, and 24 held-out questions
no run trains on.

Each method (``dpo``, ``ipo``, ``simpo`` of the rl plugin) trains through ``soup train`` with LoRA r 8 (dropout 0,
as the preference tasks require), float32, and the core's and plugin's defaults otherwise (3 epochs, batch 4,
learning rate 2e-4, beta 0.1; simpo's gamma 0.5), unless ``--beta``/``--lr``/``--epochs`` say otherwise.

Measured on the held-out questions, for the base and for each run:
- follows: the share of greedy answers (``soup eval --facts``: its rendering, greedy decoding and 48 new tokens;
  the base, which ``soup eval`` cannot name, through the same functions in this process) that open with the
  marker. Goal >= 80%; the base's share is the control.
- margin: the mean over the held-out pairs of log pi(chosen) - log pi(rejected) (summed over the completion's
  tokens, the end-of-turn token included, as trl scores them), and its growth over the base's (the DPO implicit
  reward margin over beta). Goal: it grows.

Usage: python benchmarks/real/preference.py [--only dpo,ipo,simpo] [--beta B] [--lr LR] [--epochs N] [--record]
       (offline; about 40 minutes for the three methods on one thread of a 2-core machine shared with other jobs,
       at load 11 to 13; settings other than the defaults are recorded beside them in the same file).
       ``--smoke``: the same code path on the small pretrained test model, a few pairs and 2 steps of dpo, the
       result printed (never recorded). ``--base DIR``: a model folder in place of the real model (or, with
       ``--smoke``, of the test model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

RESULTS = _common.RESULTS / "real_preference.json"
MARKER = "In short:"
METHODS = ("dpo", "ipo", "simpo")
TRAIN = [
    ("What is photosynthesis?", "Plants use sunlight, water and carbon dioxide to make sugar and release oxygen."),
    ("Why is the sky blue?",
     "Air scatters blue sunlight more than red, so blue light reaches us from every direction."),
    ("Who wrote Hamlet?", "William Shakespeare wrote Hamlet around 1600."),
    ("What is a prime number?", "A whole number above 1 that only 1 and itself divide."),
    ("What does a compiler do?", "It translates source code into machine code a computer can run."),
    ("What causes rain?", "Water vapour cools into droplets in clouds, and they fall when they grow heavy."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level."),
    ("What is gravity?", "Gravity is the force that pulls masses toward each other."),
    ("Why do leaves change colour in autumn?",
     "The green chlorophyll breaks down and shows the yellow and red pigments."),
    ("What is an atom?", "The smallest unit of a chemical element, a nucleus with electrons around it."),
    ("What is the largest ocean?", "The Pacific Ocean is the largest."),
    ("What do bees make?", "Bees make honey and wax."),
    ("What is democracy?", "A system in which the people choose their government by voting."),
    ("How does a thermometer work?", "It measures how much a liquid or a sensor changes with the temperature."),
    ("What is the speed of light?", "About 300,000 kilometres per second in a vacuum."),
    ("What is DNA?", "The molecule that carries the genetic instructions of living things."),
    ("Why do we sleep?", "Sleep lets the body and brain rest, repair and store memories."),
    ("What is a volcano?", "An opening in the Earth's crust where molten rock escapes."),
    ("What is inflation?", "A general rise in prices that lowers what money can buy."),
    ("What is the capital of Japan?", "Tokyo is the capital of Japan."),
    ("How do fish breathe?", "Fish take oxygen from water through their gills."),
    ("What is a noun?", "A word that names a person, place, thing or idea."),
    ("What is the tallest mountain?", "Mount Everest is the tallest mountain above sea level."),
    ("What is electricity?", "The flow of electric charge, usually electrons, through a conductor."),
    ("Why is exercise healthy?", "It strengthens the heart, muscles and bones and improves mood."),
    ("What is a black hole?", "A region of space whose gravity is so strong that not even light escapes."),
    ("What is recycling?", "Turning used materials into new products instead of throwing them away."),
    ("How does a rainbow form?", "Sunlight bends and reflects inside raindrops and splits into its colours."),
    ("What is the moon made of?", "Mostly rock, with a small metal core."),
    ("What is an algorithm?", "A step-by-step procedure for solving a problem."),
    ("What is a mammal?", "A warm-blooded animal with hair that feeds its young with milk."),
    ("Why does ice float?", "Ice is less dense than liquid water."),
    ("What is a verb?", "A word that describes an action or a state."),
    ("What does the heart do?", "It pumps blood around the body."),
    ("What is erosion?", "The wearing away of rock and soil by water, wind or ice."),
    ("What is a galaxy?", "A huge system of stars, gas and dust held together by gravity."),
    ("What is the internet?", "A worldwide network of connected computers."),
    ("Why do birds migrate?", "They move to places with more food and better weather."),
    ("What is a fraction?", "A number that represents part of a whole."),
]
HELD_OUT = [
    ("What is evaporation?", "Liquid turning into vapour, usually when it is heated."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci painted the Mona Lisa."),
    ("What is a planet?", "A large body that orbits a star and has cleared its path."),
    ("Why do we have seasons?", "The Earth's tilted axis changes how directly sunlight hits each place."),
    ("What is a vaccine?", "A preparation that trains the immune system to fight a disease."),
    ("What is the largest planet?", "Jupiter is the largest planet in the solar system."),
    ("How do plants drink water?", "Their roots absorb water from the soil."),
    ("What is an adjective?", "A word that describes a noun."),
    ("What is a desert?", "A region that gets very little rain."),
    ("What is friction?", "The force that resists two surfaces sliding over each other."),
    ("What does a bank do?", "It keeps money safe, lends it and pays interest."),
    ("What is a habitat?", "The natural home of a plant or an animal."),
    ("Why is the sea salty?", "Rivers carry dissolved minerals into it and evaporation leaves the salt behind."),
    ("What is a computer virus?", "A program that copies itself and harms a computer."),
    ("How many continents are there?", "There are seven continents."),
    ("What is oxygen?", "A gas in the air that animals need to breathe."),
    ("What is a poem?", "A piece of writing that uses rhythm and imagery to express feelings."),
    ("What is an earthquake?", "A sudden shaking of the ground caused by moving rock plates."),
    ("What do lungs do?", "They take oxygen into the body and remove carbon dioxide."),
    ("What is a river delta?", "Land formed where a river deposits sediment at its mouth."),
    ("What is a telescope?", "An instrument that makes distant objects look closer."),
    ("What is climate?", "The usual weather of a place over many years."),
    ("What is a calorie?", "A unit of energy, used for the energy in food."),
    ("Why do stars twinkle?", "Moving air in the atmosphere bends their light."),
]


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def rendered(tokenizer: Any, question: str) -> str:
    """The question as the model is asked it: one user turn in its chat template, with the generation prompt."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def pairs(tokenizer: Any, qa: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"prompt": rendered(tokenizer, q), "chosen": f"{MARKER} {a}", "rejected": a} for q, a in qa]


def follows(answer: str) -> bool:
    """Whether a greedy answer takes the chosen side: it opens with the marker (case and spaces aside)."""
    return answer.strip().casefold().startswith(MARKER.casefold())


def log_ratios(model: Any, tokenizer: Any, rows: list[dict[str, str]]) -> list[float]:
    """Each pair's log pi(chosen) - log pi(rejected): completion tokens only, the end-of-turn token appended, the
    prompt and each completion tokenised apart without special tokens (as trl's DPO tokenisation does)."""
    import torch

    def logp(prompt: list[int], completion: str) -> float:
        tail = tokenizer(completion + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + tail])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        return float(torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).sum())

    out = []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        out.append(logp(prompt, row["chosen"]) - logp(prompt, row["rejected"]))
    return out


def mean(xs: list[float]) -> float:
    return round(sum(xs) / max(1, len(xs)), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(METHODS), help="methods to run, comma-separated")
    parser.add_argument("--beta", type=float, help="training.beta (default: the plugin's, 0.1)")
    parser.add_argument("--lr", type=float, help="training.learning_rate (default: the core's, 2e-4)")
    parser.add_argument("--epochs", type=int, help="training.epochs (default: the core's, 3)")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the small pretrained test model, 2 steps of dpo")
    parser.add_argument("--base", help="a model folder in place of the real model (with --smoke: of the test model)")
    args = parser.parse_args()
    import torch
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from soup_core.default_plugins.transformers import greedy_answers

    work = Path(tempfile.mkdtemp(prefix="soup-preference-"))
    env = {**os.environ, "SOUP_HOME": os.environ.get("SOUP_HOME", str(work / "home"))}
    os.environ["SOUP_HOME"] = env["SOUP_HOME"]
    train_qa, held_qa, methods = TRAIN, HELD_OUT, args.only.split(",")
    if args.smoke:
        from soup_core.default_plugins.transformers.tiny_pretrained import tiny_pretrained_dir

        base, model_name = args.base or str(tiny_pretrained_dir()), "tiny_pretrained"
        train_qa, held_qa, methods = TRAIN[:4], HELD_OUT[:2], ["dpo"]
    elif args.base:
        base, model_name = args.base, Path(args.base).name
    else:
        base, model_name = _common.real_folder()
    if unknown := sorted(set(methods) - set(METHODS)):
        raise SystemExit(f"--only: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    tokenizer = AutoTokenizer.from_pretrained(base)
    train_rows, held_rows = pairs(tokenizer, train_qa), pairs(tokenizer, held_qa)
    write(work / "train.jsonl", train_rows)
    facts = write(work / "held.jsonl", [{"prompt": q, "fact": MARKER} for q, _ in held_qa])
    settings = {k: v for k, v in (("beta", args.beta), ("learning_rate", args.lr), ("epochs", args.epochs))
                if v is not None}
    suffix = "".join(f" {k}={v:g}" for k, v in settings.items())
    result: dict[str, Any] = {"benchmark": "real_preference", "smoke": args.smoke, "model": model_name,
                              "marker": MARKER, "train_pairs": len(train_rows), "held_out_pairs": len(held_rows),
                              "runs": {}}

    _common.say("the base answers the held-out questions ...")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    base_answers = greedy_answers(model, tokenizer, [q for q, _ in held_qa])
    base_margins = log_ratios(model, tokenizer, held_rows)
    result["base"] = {"follows": mean([float(follows(a)) for a in base_answers]),
                      "margin": mean(base_margins), "answers": base_answers[:3]}
    _common.say(f"base: {result['base']}")

    for method in methods:
        out = work / f"out-{method}"
        training: dict[str, Any] = {"batch_size": 4, "dtype": "float32", "seed": 0, "logging_steps": 5,
                                    "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, **settings}
        if args.smoke:
            training["max_steps"] = 2
        config = {"base": base, "task": method, "output": str(out),
                  "data": {"train": str(work / "train.jsonl"), "max_length": 256}, "training": training}
        (work / f"{method}.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
        _common.say(f"soup train ({method}{suffix}) ...")
        start = time.perf_counter()
        proc = _common.soup("train", "-c", str(work / f"{method}.yaml"), env=env, cwd=work)
        seconds = time.perf_counter() - start
        answers_json = work / f"answers-{method}.json"
        _common.soup("eval", str(out), "--facts", str(facts), "--json", str(answers_json), env=env, cwd=work)
        [evaluated] = json.loads(answers_json.read_text(encoding="utf-8"))["targets"]
        answers = [r["answer"] for r in evaluated["results"]]
        from peft import PeftModel

        trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                            str(out)).eval()
        margins = log_ratios(trained, tokenizer, held_rows)
        grown = [m - b for m, b in zip(margins, base_margins, strict=True)]
        got = {"task": method, **settings, "train_seconds": round(seconds, 1),
               "follows": mean([float(follows(a)) for a in answers]),
               "contains_marker": mean([float(r["hit"]) for r in evaluated["results"]]),
               "margin": mean(margins), "margin_growth": mean(grown),
               "pairs_margin_grew": mean([float(g > 0) for g in grown]),
               "done": proc.stdout.strip().splitlines()[-1][:200], "answers": answers[:3]}
        got["goal_follows_met"] = got["follows"] >= 0.80
        got["goal_margin_grew"] = got["margin_growth"] > 0
        if not all(math.isfinite(got[k]) for k in ("follows", "margin", "margin_growth")):
            raise SystemExit(f"{method}: a measure is not finite: {got}")
        result["runs"][method + suffix] = got
        _common.say(f"{method}{suffix}: {({k: v for k, v in got.items() if k != 'answers'})}")
    result["control_base_fails"] = result["base"]["follows"] < 0.80
    result.update(_common.machine(torch=torch.__version__))
    print(json.dumps(result, indent=2))
    if args.smoke:  # nothing of a smoke run is kept
        shutil.rmtree(work, ignore_errors=True)
    if args.record and not args.smoke:  # runs at other settings are kept beside the defaults' runs
        def merge(old: Any) -> dict[str, Any]:
            runs = {**(old or {}).get("runs", {}), **result["runs"]} if isinstance(old, dict) else result["runs"]
            return {**result, "runs": runs}

        _common.record(RESULTS, result, merge)


if __name__ == "__main__":
    main()
