"""Writes the false-alarm data sets of ``tests/fixtures/false_alarms/`` (issue 28): clean, learnable data of
the kinds on which a watchdog or a spike guard that reacts to noise stops or thins a healthy run. Every set is
small enough to train in seconds on the tiny model (``soup_core.default_plugins.transformers.tiny``); the
settings each is meant to run with, and the seeds, are in ``SETS`` below and in that folder's README.

Deterministic: every set is drawn from ``random.Random(GENERATOR_SEED)`` seeded afresh per set, so running
this again writes the same bytes (``--check`` says whether the committed files are what it writes).

    python benchmarks/false_alarm_data.py            # (re)write the files
    python benchmarks/false_alarm_data.py --check    # exit 1 when a committed file differs
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FOLDER = REPO / "tests" / "fixtures" / "false_alarms"
GENERATOR_SEED = 0

#: The training settings every set shares unless its own entry says otherwise: the quickstart's recipe
#: (``soup_core/default_plugins/commands/quickstart.py``): full fine-tuning at 5e-3, batches of 4, no
#: accumulation, a constant schedule, float32.
QUICKSTART = {"learning_rate": 5e-3, "batch_size": 4, "gradient_accumulation_steps": 1, "scheduler": "constant",
              "dtype": "float32", "lora": {"r": 0}, "epochs": 8}
#: The seeds (``training.seed`` and ``data.seed`` both) the watchdog's and the guard's rules were tuned on,
#: and those that were never looked at while tuning: the suite runs both.
TUNING_SEEDS = (0, 1)
UNTUNED_SEEDS = (2, 3, 4, 5)

_NAMES = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kai", "Lu"]
_THINGS = ["apples", "books", "cups", "stones", "pens", "shells", "coins", "keys"]
_WORDS = ["red", "blue", "green", "cat", "dog", "tree", "river", "stone", "cloud", "lamp", "door", "bird",
          "fish", "moon", "sun", "road", "hill", "book", "song", "rain"]


def chat(user: str, assistant: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def _sum_row(rng: random.Random) -> dict[str, Any]:
    """The quickstart's kind of row: a short sum, answered in a short sentence."""
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return chat(f"{name} has {a} {thing} and finds {b} more. How many {thing} now?", f"{name} has {a + b} {thing}.")


def classification(rng: random.Random) -> list[dict[str, Any]]:
    """200 sentences, each labelled with its topic by one word (the label is decided by the sentence's nouns)."""
    topics = {
        "sports": ["ball", "goal", "team", "match", "coach", "score", "race", "court"],
        "food": ["bread", "soup", "cheese", "apple", "rice", "cake", "pasta", "salad"],
        "weather": ["rain", "storm", "wind", "snow", "cloud", "sun", "fog", "frost"],
        "music": ["song", "drum", "guitar", "band", "choir", "piano", "tune", "violin"],
    }
    verbs = ["mentions", "is about", "talks of", "describes", "shows"]
    rows = []
    for i in range(200):
        label = list(topics)[i % len(topics)]
        a, b = rng.sample(topics[label], 2)
        sentence = f"The note {rng.choice(verbs)} the {a} and the {b}."
        rows.append(chat(f"Topic of: {sentence} Answer sports, food, weather or music.", label))
    rng.shuffle(rows)
    return rows


def copy(rng: random.Random) -> list[dict[str, Any]]:
    """200 rows: repeat 3 to 8 words exactly. Its loss falls near zero, where one hard batch's gradient is
    many times the median (issue 28: stopped at full fine-tuning lr 1e-3)."""
    rows = []
    for _ in range(200):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8)))
        rows.append(chat(f"Repeat exactly: {words}", words))
    return rows


def mixed_lengths(rng: random.Random) -> list[dict[str, Any]]:
    """152 short sums and 8 long, correct answers (counting out a range of numbers one by one) among them."""
    rows = [_sum_row(rng) for _ in range(152)]
    for _ in range(8):
        start = rng.randint(1, 20)
        stop = start + rng.randint(40, 60)
        answer = ", ".join(str(n) for n in range(start, stop + 1)) + "."
        rows.insert(rng.randrange(len(rows) + 1), chat(f"Count from {start} to {stop}.", answer))
    return rows


def docstrings(rng: random.Random) -> list[dict[str, Any]]:
    """160 sums and 40 rows asking for a function's docstring (longer, another vocabulary), shuffled."""
    verbs = [("add", "Return the sum of {a} and {b}."), ("scale", "Return {a} multiplied by {b}."),
             ("clip", "Return {a} limited to at most {b}."), ("pick", "Return {a} when it is set, else {b}."),
             ("join", "Return {a} and {b} joined into one string.")]
    rows = [_sum_row(rng) for _ in range(160)]
    for _ in range(40):
        name, doc = rng.choice(verbs)
        a, b = rng.sample(["x", "y", "value", "limit", "count", "text", "other"], 2)
        body = doc.format(a=a, b=b)
        rows.append(chat(f"Write the docstring of def {name}({a}, {b}):",
                         f'"""{body}\n\nArgs:\n    {a}: the first argument.\n    {b}: the second argument.\n"""'))
    rng.shuffle(rows)
    return rows


def sentiment(rng: random.Random) -> list[dict[str, Any]]:
    """200 alpaca rows: a short review, answered ``positive`` or ``negative`` (100 of each)."""
    good = ["great", "lovely", "excellent", "wonderful", "superb", "pleasant"]
    bad = ["awful", "terrible", "boring", "dreadful", "poor", "dull"]
    items = ["film", "meal", "book", "hotel", "concert", "game", "phone", "trip"]
    rows = []
    for i in range(200):
        positive = i % 2 == 0
        adjective = rng.choice(good if positive else bad)
        review = f"The {rng.choice(items)} was {adjective}, {rng.choice(['really', 'truly', 'quite', 'very'])}."
        rows.append({"instruction": "Is this review positive or negative?", "input": review,
                     "output": "positive" if positive else "negative"})
    rng.shuffle(rows)
    return rows


def curriculum_1(rng: random.Random) -> list[dict[str, Any]]:
    """Phase 1 of a curriculum: 120 short sums."""
    return [_sum_row(rng) for _ in range(120)]


def curriculum_2(rng: random.Random) -> list[dict[str, Any]]:
    """Phase 2: 120 harder rows (a product of two numbers, and the words of a list in reverse), whose loss
    starts above phase 1's end. Trained from phase 1's output (its ``base``)."""
    rows = []
    for i in range(120):
        if i % 2:
            a, b = rng.randint(2, 12), rng.randint(2, 12)
            rows.append(chat(f"What is {a} times {b}?", f"{a} times {b} is {a * b}."))
        else:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 6))]
            rows.append(chat(f"Reverse the words: {' '.join(words)}", " ".join(reversed(words))))
    return rows


def many_epochs(rng: random.Random) -> list[dict[str, Any]]:
    """The quickstart's clean rows (its data set without the malformed row 17), for 30 epochs."""
    from soup_core.default_plugins.commands.quickstart import POISONED_ROW, synthetic_rows

    return [row for i, row in enumerate(synthetic_rows()) if i != POISONED_ROW]


#: name -> (builder, format, the ``training`` settings it is meant to run with, over QUICKSTART's, and
#: ``base``: "tiny" or "phase 1's output")
SETS: dict[str, tuple[Callable[[random.Random], list[dict[str, Any]]], str, dict[str, Any], str]] = {
    "classification": (classification, "chat", {}, "tiny"),
    "copy": (copy, "chat", {"learning_rate": 1e-3, "epochs": 6}, "tiny"),
    "mixed_lengths": (mixed_lengths, "chat", {"epochs": 6}, "tiny"),
    "docstrings": (docstrings, "chat", {"epochs": 6}, "tiny"),
    "sentiment": (sentiment, "alpaca", {"epochs": 6}, "tiny"),
    "curriculum_1": (curriculum_1, "chat", {"epochs": 4}, "tiny"),
    "curriculum_2": (curriculum_2, "chat", {"epochs": 6}, "curriculum_1's output"),
    "many_epochs": (many_epochs, "chat", {"epochs": 30}, "tiny"),
}
#: A run on a set above with other settings: LoRA at lr 1e-2 for 800 steps (issue 28: stopped at step 494).
RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "lora_lr_1e-2": ("classification", {"learning_rate": 1e-2, "lora": {"r": 8}, "max_steps": 800}),
}


def settings(name: str) -> dict[str, Any]:
    """The ``training`` settings set or run ``name`` is meant to run with."""
    if name in RUNS:
        data, extra = RUNS[name]
        return {**settings(data), **extra}
    return {**QUICKSTART, **SETS[name][2]}


def content(name: str) -> str:
    rows = SETS[name][0](random.Random(f"{GENERATOR_SEED}:{name}"))
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare the committed files, write nothing")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    stale = []
    for name in SETS:
        path = FOLDER / f"{name}.jsonl"
        text = content(name)
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
            continue
        FOLDER.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    if stale:
        print(f"differ from what benchmarks/false_alarm_data.py writes: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
