"""``soup eval --tasks`` through lm-evaluation-harness on the real model (issue 34, eval): a local task of the
quickstart's held-out facts, the base and the trained model side by side.

The trained model: the quickstart's recipe (``soup quickstart``'s rows, teaching SmolLM2-135M-Instruct the name
"Basil"; LoRA r 8, batch 4, float32, seed 0; all 51 steps, or ``--steps N`` of them cut as ``mlx_answers.py``
cuts them, the peak learning rate raised to keep the schedule's area: 5e-4 x 51 / N), or an earlier run's output
folder (``--run``, e.g. the transformers run of ``mlx_answers.py --work DIR``: ``DIR/transformers/output``).

The tasks are written into a temporary folder (YAML, JSON Lines and a scoring function; nothing is downloaded),
each question as one user turn rendered with the run's chat template, answered greedily by lm-eval
(``generate_until``, at most 48 new tokens, as ``soup eval --facts`` answers), and scored as ``soup eval --facts``
scores (the fact appears in the answer, case-insensitive):

- ``soup_name``: the quickstart's 24 held-out name questions, fact "Basil" (phrasings no row trained on);
- ``soup_retain``: its 23 retain questions, each with its key fact (what the model must keep);
- ``soup_name_scrambled``: the held-out name questions with a wrong answer key (the retain facts in turn: "Paris",
  "Tokyo", ...).

One command, ``soup eval RUN --tasks soup_name,soup_retain,soup_name_scrambled --include-path DIR --base``,
scores the base (the run's adapter turned off) and the trained model, one column each. Controls: the base must
score lower than the trained model on ``soup_name`` (the base never calls itself Basil), and both must score
near 0 on ``soup_name_scrambled`` (a measure that passed any answer would not).

Usage: python benchmarks/real/eval_tasks.py [--run OUTPUT] [--steps N] [--record]
       (about 3 minutes on 2 CPUs with --run, 5 training the recipe itself; nothing is downloaded)
       python benchmarks/real/eval_tasks.py --smoke --base DIR   (the same code path on a small model, 2 steps)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

RESULTS = _common.RESULTS / "real_eval_tasks.json"
TASKS = ("soup_name", "soup_retain", "soup_name_scrambled")

SCORER = '''"""soup eval --facts's score: the fact appears in the answer, case-insensitive."""


def stated(doc, results):
    return {"stated": float(doc["fact"].lower() in results[0].lower())}
'''
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{text}}}}"
doc_to_target: "{{{{fact}}}}"
generation_kwargs:
  until: [{stop}]
  do_sample: false
  max_gen_toks: 48
process_results: !function scorer.stated
metric_list:
  - metric: stated
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(folder: Path, tokenizer_dir: Path) -> dict[str, int]:
    """The three tasks' YAML, data and scorer in ``folder``; each task's number of documents."""
    from transformers import AutoTokenizer

    from soup_core.default_plugins.commands.quickstart_real import HELD_OUT, RETAIN
    from soup_core.default_plugins.transformers import read_facts

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def rendered(prompt: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)

    held, retain = read_facts(HELD_OUT), read_facts(RETAIN)
    docs = {"soup_name": [(q.prompt, q.fact) for q in held],
            "soup_retain": [(q.prompt, q.fact) for q in retain],
            "soup_name_scrambled": [(q.prompt, retain[i % len(retain)].fact) for i, q in enumerate(held)]}
    (folder / "scorer.py").write_text(SCORER, encoding="utf-8")
    for task, rows in docs.items():
        data = folder / f"{task}.jsonl"
        data.write_text("".join(json.dumps({"text": rendered(p), "fact": f}) + "\n" for p, f in rows),
                        encoding="utf-8")
        (folder / f"{task}.yaml").write_text(TASK_YAML.format(task=task, data=data,
                                                              stop=json.dumps(tokenizer.eos_token)),
                                             encoding="utf-8")
    return {task: len(rows) for task, rows in docs.items()}


def train(base: Path, work: Path, steps: int, env: dict[str, str]) -> Path:
    """The quickstart's recipe cut to ``steps`` (the learning rate keeping the full schedule's area), on the
    transformers backend; its output folder."""
    import yaml

    from soup_core.default_plugins.commands import quickstart_real

    config_path = quickstart_real.prepare(work / "run", base)
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    if steps:
        config["training"]["max_steps"] = steps
        config["training"]["learning_rate"] = _common.quickstart_cut_rate(steps)
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    _common.say(f"soup train ({steps or 'all'} steps of the quickstart's recipe) ...")
    _common.soup("train", "--config", str(config_path), "--overwrite", env=env, cwd=work)
    return work / "run" / "output"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=None, help="a trained quickstart run's output folder")
    parser.add_argument("--steps", type=int, default=0, help="without --run: cut the recipe to its first N "
                        "optimizer steps (default 0: the full recipe, 51 steps)")
    parser.add_argument("--smoke", action="store_true", help="the small pretrained test model, 2 steps")
    parser.add_argument("--base", type=Path, default=None, help="with --smoke: the small model's folder")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        from soup_core.default_plugins.transformers.tiny_pretrained import tiny_pretrained_dir

        base, steps = args.base or tiny_pretrained_dir(), 2
    else:
        base, steps = _common.real_gguf(), args.steps
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        output = args.run.resolve() if args.run else train(Path(base), work, steps, env)
        folder = work / "tasks"
        folder.mkdir()
        docs = write_tasks(folder, output)
        _common.say("soup eval --tasks ... --base ...")
        report = work / "tasks.json"
        shown = _common.soup("eval", str(output), "--tasks", ",".join(TASKS), "--include-path", str(folder),
                             "--base", "--json", str(report), env={**env, "COLUMNS": "120"}, cwd=work)
        targets = json.loads(report.read_text(encoding="utf-8"))["targets"]
    print(shown.stdout, file=sys.stderr)  # soup eval's own table: the base beside the trained model
    base_scores, trained_scores = (t["results"] for t in targets)

    def share(scores: dict[str, Any], task: str) -> float:
        return round(float(scores[task]["stated"]), 4)

    table = {task: {"documents": docs[task], "base": share(base_scores, task), "trained": share(trained_scores, task),
                    "trained_stderr": round(float(trained_scores[task].get("stated_stderr", float("nan"))), 4)}
             for task in TASKS}
    result = {
        "benchmark": "real_eval_tasks", "model": Path(base).name, "smoke": args.smoke,
        "trained": str(args.run) if args.run else f"the quickstart's recipe, {steps or 'all'} steps",
        "command": f"soup eval RUN --tasks {','.join(TASKS)} --include-path DIR --base --json PATH",
        "tasks": table,
        "controls": {"base_below_trained_on_name": table["soup_name"]["base"] < table["soup_name"]["trained"],
                     "scrambled_near_zero": max(table["soup_name_scrambled"]["base"],
                                                table["soup_name_scrambled"]["trained"]) <= 0.1},
        **_common.machine(),
    }
    print(json.dumps(result, indent=2))
    if args.record and not args.smoke:
        _common.record(RESULTS, result)


if __name__ == "__main__":
    main()
