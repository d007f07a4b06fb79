"""Real distillation runs through ``soup train`` on tiny models (CPU, real transformers/trl/peft).

The acceptance run distils an sft-trained teacher into a freshly initialised student and measures that
the distillation term falls and that the student's greedy predictions come to agree with the teacher's on
rows it never trained on. The other runs pin down what the per-row losses are, gradient accumulation,
LoRA with checkpoints and resume, evaluation, packing, and the refusals made at set-up.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from soup_core.testing import TrainingFailed, train_in_process, write_jsonl, write_yaml

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
F = torch.nn.functional


def arithmetic_rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                ]
            }
        )
    return rows


@pytest.fixture(scope="session")
def sft_teacher(models, tmp_path_factory, torch_one_thread) -> Path:
    """The student-tokenizer tiny model after a short sft run (full fine-tuning) on arithmetic rows,
    trained with the core's sft task through ``soup train``."""
    root = tmp_path_factory.mktemp("teacher")
    config = {
        "base": str(models["student"]),
        "output": str(root / "teacher"),
        "data": {"train": str(write_jsonl(root / "train.jsonl", arithmetic_rows(48, seed=0))), "max_length": 64},
        "training": {"epochs": 6, "batch_size": 8, "learning_rate": 1e-2, "lora": {"r": 0}},
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOUP_HOME", str(root / "home"))
        train_in_process(config, workdir=root, installed=False)
    return root / "teacher"


def _agreement(student_dir: Path, teacher_dir: Path, rows: list[dict[str, Any]]) -> float:
    """The fraction of supervised positions where the student's and the teacher's greedy next tokens agree."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.sft import encode_rows

    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    same = total = 0
    with torch.no_grad():
        for example in encode_rows(rows, tokenizer, max_length=64):
            ids = torch.tensor([example["input_ids"]])
            mask = torch.tensor(example["labels"][1:]) != -100
            mine = student(input_ids=ids).logits[0, :-1].argmax(-1)[mask]
            theirs = teacher(input_ids=ids).logits[0, :-1].argmax(-1)[mask]
            same += int((mine == theirs).sum())
            total += int(mask.sum())
    return same / total


def _config(folder: Path, base: Path, teacher: Path | str, rows, *, data=None, training=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    train = write_jsonl(folder / "train.jsonl", rows)
    return write_yaml(
        folder / "soup.yaml",
        {
            "base": str(base),
            "task": "distill",
            "output": str(folder / "out"),
            "data": {"train": str(train), "max_length": 64, **(data or {})},
            "training": {
                "teacher_model": str(teacher),
                "batch_size": 4,
                "logging_steps": 1,
                "lora": {"r": 0},
                **(training or {}),
            },
        },
    )


def _metrics(run_index: int = 0) -> list[tuple[int, dict[str, float]]]:
    from soup_core import Tracker

    tracker = Tracker()
    runs = tracker.list_runs()
    return tracker.metrics(runs[run_index].run_id)


# --------------------------------------------------------------------------------------- acceptance


def test_distilling_an_sft_teacher_into_a_fresh_student(
    sft_teacher, models, tmp_path, soup_train
):
    rows = arithmetic_rows(48, seed=0)
    held_out = arithmetic_rows(16, seed=1)
    steps = 36
    config = _config(
        tmp_path,
        models["other"],
        sft_teacher,
        rows,
        training={"max_steps": steps, "batch_size": 8, "learning_rate": 5e-3},
    )
    before = _agreement(models["other"], sft_teacher, held_out)
    run = soup_train(config)
    after = _agreement(tmp_path / "out", sft_teacher, held_out)

    # The distillation term (T^2 times forward KL, per supervised token) falls.
    metrics = _metrics()
    assert [step for step, _ in metrics] == list(range(1, steps + 1))
    kd = [m["distill_loss"] for _, m in metrics]
    assert all(math.isfinite(v) for v in kd)
    first, last = sum(kd[:5]) / 5, sum(kd[-5:]) / 5
    assert last < 0.5 * first, kd
    # The fresh student's greedy predictions rarely match the teacher's; after distillation most do, on rows
    # it never trained on.
    assert before < 0.2 and after > 0.4 and after > before + 0.3, (before, after)
    assert {"ce_loss", "teacher_agreement", "loss", "grad_norm"} <= set(metrics[-1][1])

    # The rewind log holds every micro-batch with the per-row losses of the trained objective.
    log = [json.loads(line) for line in (tmp_path / "out" / "rewind.jsonl").read_text().splitlines()]
    header, batches = log[0], log[1:]
    assert header["task"] == "distill" and len(batches) == steps == len(run.micro)
    for batch, event in zip(batches, run.micro, strict=True):
        assert batch["rows"] == list(event.rows) and batch["row_tokens"] == list(event.row_tokens)
        assert all(math.isfinite(v) and v > 0 for v in batch["row_loss"])
        assert all(t > 0 for t in batch["row_tokens"])
    # 36 steps of 8 rows over 48 rows: six whole epochs, every row six times
    assert sorted(r for b in batches for r in b["rows"]) == sorted(list(range(48)) * 6)


# ------------------------------------------------------------------------------------ per-row losses


def _by_hand(student_dir: Path, teacher_dir: Path, rows, *, weight: float, temperature: float):
    """Per row: (mean combined loss, mean CE, summed CE, summed T^2*JS, supervised tokens), one row at a time
    (no padding), with the textbook JS in float64 probability space."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.sft import encode_rows

    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    out = []
    with torch.no_grad():
        for example in encode_rows(rows, tokenizer, max_length=64):
            ids = torch.tensor([example["input_ids"]])
            targets = torch.tensor(example["labels"][1:])
            mask = targets != -100
            s_logits = student(input_ids=ids).logits[0, :-1][mask].double()
            t_logits = teacher(input_ids=ids).logits[0, :-1][mask].double()
            ce = F.cross_entropy(s_logits, targets[mask], reduction="none")
            s = torch.softmax(s_logits / temperature, -1)
            t = torch.softmax(t_logits / temperature, -1)
            m = (s + t) / 2
            js = 0.5 * (s * (s / m).log()).sum(-1) + 0.5 * (t * (t / m).log()).sum(-1)
            kd = js * temperature**2
            n = int(mask.sum())
            combined = ((1 - weight) * ce + weight * kd).sum() / n
            out.append((float(combined), float(ce.sum() / n), float(ce.sum()), float(kd.sum()), n))
    return out


def test_per_row_losses_are_those_of_the_combined_objective(
    models, tmp_path, chat_rows, soup_train, monkeypatch
):
    import soup_plugin_distill.trainer as trainer_module

    loaded: list[Any] = []
    real_load = trainer_module.load_teacher

    def counting_load(*args: Any, **kwargs: Any) -> Any:
        loaded.append(real_load(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(trainer_module, "load_teacher", counting_load)
    rows = chat_rows(8)
    weight, temperature = 0.3, 1.5
    config = _config(
        tmp_path,
        models["other"],
        models["student"],
        rows,
        training={
            "max_steps": 2,
            "distill_divergence": "js",
            "distill_weight": weight,
            "distill_temperature": temperature,
            "learning_rate": 1e-3,
        },
    )
    first = soup_train(config, with_rewind=False).micro[0]
    assert first.step == 1 and len(first.rows) == 4
    expected = _by_hand(models["other"], models["student"], rows, weight=weight, temperature=temperature)
    for row, loss, tokens in zip(first.rows, first.row_loss, first.row_tokens, strict=True):
        combined, ce_mean, _, _, n = expected[row]
        assert tokens == n
        assert loss == pytest.approx(combined, rel=1e-4), row
        assert abs(loss - ce_mean) > 1e-2  # control: the cross-entropy alone is a different number

    # The step's terms in the tracker are the token-weighted means over the step's rows, and the
    # cross-entropy term is the model's own shifted loss on those rows.
    step_one = dict(_metrics()[0][1])
    ce_sum = sum(expected[r][2] for r in first.rows)
    kd_sum = sum(expected[r][3] for r in first.rows)
    n = sum(expected[r][4] for r in first.rows)
    assert step_one["ce_loss"] == pytest.approx(ce_sum / n, rel=1e-4)
    assert step_one["distill_loss"] == pytest.approx(kd_sum / n, rel=1e-4)
    assert step_one["loss"] == pytest.approx(((1 - weight) * ce_sum + weight * kd_sum) / n, rel=1e-4)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.sft import encode_rows

    model = AutoModelForCausalLM.from_pretrained(models["other"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(models["other"])
    encoded = encode_rows([rows[r] for r in first.rows], tokenizer, max_length=64)
    with torch.no_grad():
        hf = sum(
            float(model(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]])).loss)
            * expected[r][4]
            for e, r in zip(encoded, first.rows, strict=True)
        )
    assert step_one["ce_loss"] == pytest.approx(hf / n, rel=1e-4)

    # The teacher was loaded once, stays in eval mode with no trainable parameter, and did not change.
    from safetensors.torch import load_file

    (teacher,) = loaded
    assert teacher.training is False and not any(p.requires_grad for p in teacher.parameters())
    on_disk = load_file(models["student"] / "model.safetensors")
    state = teacher.state_dict()
    assert on_disk and all(torch.equal(state[k], v) for k, v in on_disk.items())
    # control: the student did train (its saved weights moved away from where it started)
    trained = load_file(tmp_path / "out" / "model.safetensors")
    start = load_file(models["other"] / "model.safetensors")
    assert any(not torch.equal(trained[k], start[k]) for k in start)


# ------------------------------------------------------------------------------ gradient accumulation


def test_gradient_accumulation_matches_one_larger_batch(
    sft_teacher, models, tmp_path, soup_train
):
    # The sft-trained model as the student: its loss is low on the arithmetic it learned and high on junk,
    # so micro-batches differ in per-token loss as well as in length, and a wrong normalisation shows.
    junk = random.Random(3)
    answers = ["".join(junk.choice("qzxjkvwy#@!%&* ") for _ in range(40 + 30 * i)) for i in range(4)]
    rows = arithmetic_rows(4, seed=0) + [
        {"messages": [{"role": "user", "content": "What is 1 plus 1?"}, {"role": "assistant", "content": a}]}
        for a in answers
    ]
    from soup_core import micro_batches

    def arithmetic_then_junk(seed: int) -> bool:
        first, second = micro_batches(8, batch_size=2, epoch=0, seed=seed)[:2]
        return all(r < 4 for r in first) and all(r >= 4 for r in second)

    seed = next(
        s for s in range(1000) if arithmetic_then_junk(s)
    )  # the core's order, made unequal on purpose
    steps = {}
    for name, batch, accumulation in (("one", 4, 1), ("two", 2, 2)):
        config = _config(
            tmp_path / name,
            sft_teacher,
            models["student"],
            rows,
            data={"seed": seed},
            training={"max_steps": 1, "batch_size": batch, "gradient_accumulation_steps": accumulation},
        )
        steps[name] = soup_train(config, with_rewind=False)
    one, two = steps["one"], steps["two"]
    assert sorted(one.micro[0].rows) == sorted(two.micro[0].rows + two.micro[1].rows)
    a, b = one.steps[0].metrics, two.steps[0].metrics
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    # control: averaging the two micro-batches' own means (the classic accumulation bug) is another number
    means = [
        sum(loss * n for loss, n in zip(m.row_loss, m.row_tokens, strict=True)) / sum(m.row_tokens)
        for m in two.micro
    ]
    assert abs(sum(means) / 2 - a["loss"]) > 0.02 * a["loss"], (means, a["loss"])


# --------------------------------------------------------------------- LoRA, checkpoints, resume, eval


def test_lora_student_checkpoints_resume_and_eval(models, tmp_path, chat_rows, soup_train):
    from safetensors.torch import load_file

    rows = chat_rows(12)
    training = {
        "max_steps": 4,
        "save_steps": 2,
        "eval_steps": 2,
        "learning_rate": 5e-3,
        "lora": {"r": 8, "dropout": 0.0},
        "distill_divergence": "reverse_kl",
    }
    data = {"val_split": 0.25}
    straight = _config(
        tmp_path / "a", models["other"], models["student"], rows, data=data, training=training
    )
    first_run = soup_train(straight, with_rewind=False)
    checkpoint = tmp_path / "a" / "out" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").is_file()
    evals = {step: m for step, m in _metrics() if "eval_loss" in m}
    assert sorted(evals) == [2, 4]
    assert all(
        math.isfinite(m["eval_loss"]) and math.isfinite(m["eval_distill_loss"]) for m in evals.values()
    )

    resumed = _config(
        tmp_path / "b",
        models["other"],
        models["student"],
        rows,
        data=data,
        training={**training, "resume_from": str(checkpoint)},
    )
    second_run = soup_train(resumed, with_rewind=False)
    assert [e.step for e in second_run.micro] == [3, 4]
    assert [e.rows for e in second_run.micro] == [e.rows for e in first_run.micro if e.step > 2]
    end_a = load_file(tmp_path / "a" / "out" / "adapter_model.safetensors")
    end_b = load_file(tmp_path / "b" / "out" / "adapter_model.safetensors")
    assert end_a.keys() == end_b.keys() and all(torch.equal(end_a[k], end_b[k]) for k in end_a)
    at_two = load_file(checkpoint / "adapter_model.safetensors")  # control: training moved on after step 2
    assert any(not torch.equal(at_two[k], end_a[k]) for k in end_a)


def test_packed_rows_get_the_same_per_row_losses(models, tmp_path, chat_rows, soup_train):
    rows = chat_rows(8)
    runs = []
    for name, packing in (("padded", False), ("packed", True)):
        config = _config(
            tmp_path / name,
            models["other"],
            models["student"],
            rows,
            data={"packing": packing},
            training={"max_steps": 1, "distill_divergence": "js"},
        )
        runs.append(soup_train(config, with_rewind=False))
    padded, packed = (r.micro[0] for r in runs)
    assert padded.rows == packed.rows and padded.row_tokens == packed.row_tokens
    assert packed.row_loss == pytest.approx(padded.row_loss, rel=1e-4)


# ------------------------------------------------------------------------------------ set-up refusals


def _swapped_tokenizer_teacher(models, folder: Path) -> Path:
    import shutil

    shutil.copytree(models["student"], folder)
    doc = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = doc["model"]["vocab"]
    a, b = "a", "b"  # byte-level BPE always has the single letters
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(doc), encoding="utf-8")
    return folder


@pytest.mark.parametrize("teacher", ["small_vocab", "swapped_tokenizer"])
def test_setup_refuses_a_teacher_that_does_not_share_the_vocabulary(
    models, tmp_path, chat_rows, soup_train, teacher
):
    from transformers import AutoTokenizer

    if teacher == "small_vocab":
        folder = models["small_vocab"]
        size = len(AutoTokenizer.from_pretrained(models["student"]))
        expected = [f"predicts over 600 tokens but the student {str(models['other'])!r} over {size}"]
    else:
        folder = _swapped_tokenizer_teacher(models, tmp_path / "swapped")
        expected = ["the teacher's tokenizer", "differs from the student's", "2 tokens map to other ids"]
    config = _config(tmp_path, models["other"], folder, chat_rows(4), training={"max_steps": 1})
    # Without the pre-flight (which refuses the size mismatch of local folders early), set-up must refuse.
    with pytest.raises(TrainingFailed) as refused:
        soup_train(config, with_rewind=False, preflight=False)
    err = " ".join(refused.value.message.split())
    assert all(text in err for text in expected), err


def test_controllers_may_change_the_coefficients_within_their_ranges():
    from soup_core.default_plugins.transformers import BackendError
    from soup_plugin_distill.trainer import DistillTrainer

    assert DistillTrainer.soup_coefficients == ("distill_weight", "distill_temperature")
    trainer = DistillTrainer.__new__(DistillTrainer)  # the setters need no trainer state
    trainer.distill_weight, trainer.distill_temperature = 0.8, 0.5
    assert (trainer.distill_weight, trainer.distill_temperature) == (0.8, 0.5)
    with pytest.raises(BackendError, match="distill_weight must be between 0 and 1, got 1.5"):
        trainer.distill_weight = 1.5
    with pytest.raises(BackendError, match="distill_temperature must be between 0.01 and 20, got 0"):
        trainer.distill_temperature = 0.0
    assert (trainer.distill_weight, trainer.distill_temperature) == (0.8, 0.5)  # refused values left no trace


# ----------------------------------------------------------------- the teacher's tokenizer, wherever it is


def _weights_only(models, folder: Path) -> Path:
    """The ``other`` model's folder without its tokenizer files."""
    import shutil

    from soup_plugin_distill.teacher import TOKENIZER_FILES

    shutil.copytree(models["other"], folder)
    for name in (*TOKENIZER_FILES, "special_tokens_map.json", "merges.txt", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    return folder


@pytest.mark.parametrize("preflight", [True, False])
def test_a_teacher_folder_without_a_tokenizer_is_refused(models, tmp_path, chat_rows, soup_train, preflight):
    import shutil

    teacher = _weights_only(models, tmp_path / "weights-only")
    config = _config(tmp_path / "run", models["student"], teacher, chat_rows(4), training={"max_steps": 1})
    with pytest.raises(TrainingFailed) as refused:
        soup_train(config, with_rewind=False, preflight=preflight)
    err = " ".join(refused.value.message.split())
    assert "holds no tokenizer" in err and str(teacher) in err and "tokenizer.save_pretrained" in err, err
    assert not [e for e in refused.value.events if type(e).__name__ == "MicroBatch"]  # nothing trained
    # control: the same weights with the student's tokenizer saved beside them train
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(models["student"]).save_pretrained(teacher)
    shutil.rmtree(tmp_path / "run" / "out", ignore_errors=True)
    assert soup_train(config, with_rewind=False, preflight=preflight).status == "completed"


def _hub_cache(root: Path, repo: str, source: Path) -> Path:
    """A Hugging Face hub cache holding ``source``'s files as the snapshot of ``repo`` (offline tests)."""
    import shutil

    entry = root / ("models--" + repo.replace("/", "--"))
    commit = "0" * 40
    shutil.copytree(source, entry / "snapshots" / commit)
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit, encoding="utf-8")
    return root


@pytest.mark.parametrize("tokenizer", ["swapped", "none", "student"])
def test_a_hub_teacher_s_tokenizer_is_checked_after_loading(
    models, tmp_path, chat_rows, soup_train, monkeypatch, tokenizer
):
    import huggingface_hub.constants

    if tokenizer == "swapped":
        source = _swapped_tokenizer_teacher(models, tmp_path / "src")
    elif tokenizer == "none":
        source = _weights_only(models, tmp_path / "src")
    else:
        source = models["other"]
    cache = _hub_cache(tmp_path / "hub", "soup-test/teacher", source)
    # transformers reads the cache folder from huggingface_hub's constants at each call
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = _config(tmp_path / "run", models["student"], "soup-test/teacher", chat_rows(4),
                     training={"max_steps": 1})
    if tokenizer == "student":  # control: a hub teacher with the student's tokenizer trains
        assert soup_train(config, with_rewind=False).status == "completed"
        return
    with pytest.raises(TrainingFailed) as refused:
        soup_train(config, with_rewind=False)
    err = " ".join(refused.value.message.split())
    expected = "2 tokens map to other ids" if tokenizer == "swapped" else "cannot load the tokenizer"
    assert expected in err and "'soup-test/teacher'" in err, err
    assert not [e for e in refused.value.events if type(e).__name__ == "MicroBatch"]  # before the first step


def test_gguf_student_and_teacher_train_as_the_folders_they_came_from(models, tmp_path, chat_rows, soup_train):
    """A student and a teacher given as GGUF files (F32: dequantised exactly; tokenizers read from the files,
    which add GPT-2's ``<|endoftext|>`` to the tiny vocabulary, so both must come from GGUF files to share
    one) give, step for step, the losses of the same models given as folders."""
    from soup_core.default_plugins.transformers.tiny import build_tiny_gguf

    student = build_tiny_gguf(models["other"], tmp_path / "student.gguf")
    teacher = build_tiny_gguf(models["student"], tmp_path / "teacher.gguf")
    rows, training = chat_rows(8), {"max_steps": 2, "learning_rate": 5e-3, "lora": {"r": 4, "dropout": 0.0}}
    soup_train(_config(tmp_path / "folder", models["other"], models["student"], rows, training=training),
               with_rewind=False)
    from_folders = [m for _, m in _metrics()]
    soup_train(_config(tmp_path / "gguf", student, teacher, rows, training=training), with_rewind=False)
    from_gguf = [m for _, m in _metrics()]
    keys = ("loss", "distill_loss")
    assert len(from_gguf) == len(from_folders) > 0
    assert [[m.get(k) for k in keys] for m in from_gguf] == [[m.get(k) for k in keys] for m in from_folders]
    assert all(m.get("distill_loss", 0) > 0 for m in from_gguf)  # the control: the teacher's logits count
