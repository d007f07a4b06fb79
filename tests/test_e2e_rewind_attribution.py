"""Acceptance (issue 4): the rewind log names the rows that really trained, checked through an independent
channel, for gradient accumulation, packing, a resumed run and a 2-process DDP run.

The independent channel: every data row carries its own index in its text (``row 17 asks``). A test-only plugin loads
the model the built-in way (``soup_core.default_plugins.transformers.load_model_and_tokenizer``) and registers a forward
pre-hook that writes the token ids and labels really reaching the model's forward, plus how many optimizer steps had run
(a global torch optimizer hook), to a file. The test decodes those ids with the tokenizer, reads the row markers back
out of the text, and compares them, per (step, micro), with ``rewind.jsonl``.
Nothing here reads the row-index plumbing the recorder uses (``row_index`` / ``token_slot``).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

CAPTURE_ENV = "SOUP_TEST_CAPTURE"
MARKER = re.compile(r"row (\d+) asks")
IGNORE = -100

# The capture plugin, as source: loaded in-process from a file, and installed as a real distribution
# (entry point) for the torchrun ranks of the DDP test.
CAPTURE_SOURCE = '''
"""Test-only plugin: the built-in model loading, plus a record of what reaches the model's forward."""
import json
import os

from torch.optim.optimizer import register_optimizer_step_post_hook

from soup_core import hookimpl, load_model_and_tokenizer

SOUP_HOOK_API = (1, 1)
_STEPS = {"done": 0}
_HANDLES = []


def _count_step(optimizer, args, kwargs):
    _STEPS["done"] += 1


@hookimpl
def soup_load_model(config, backend, task):
    if backend != "transformers":
        return None
    loaded = load_model_and_tokenizer(config)
    path = os.environ["SOUP_TEST_CAPTURE"] + ".rank" + os.environ.get("RANK", "0") + ".jsonl"
    for handle in _HANDLES:  # one global step counter per run, not one per run this process has seen
        handle.remove()
    _HANDLES.clear()
    _STEPS["done"] = 0
    _HANDLES.append(register_optimizer_step_post_hook(_count_step))

    def capture(module, args, kwargs):
        if not module.training:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        labels = kwargs.get("labels")
        line = {
            "steps_done": _STEPS["done"],
            "ids": ids.tolist(),
            "labels": labels.tolist() if labels is not None else None,
        }
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\\n")

    loaded.model.register_forward_pre_hook(capture, with_kwargs=True)
    return loaded
'''


# ------------------------------------------------------------------------------------------ helpers


def _rows(n: int) -> list[dict[str, Any]]:
    """Chat rows naming their own index, of varied lengths (so padding and packing really vary)."""
    return [
        {
            "messages": [
                {"role": "user", "content": f"row {i} asks: what is {i} plus {i}?"},
                {"role": "assistant", "content": f"It is {2 * i}." + " Indeed" * (i % 5)},
            ]
        }
        for i in range(n)
    ]


def _write_data(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(n)), encoding="utf-8")
    return path


def _write_config(path: Path, *, model: Path, data: Path, output: Path, data_extra: str = "", training: str) -> Path:
    path.write_text(
        f"base: {model}\noutput: {output}\n"
        f"data:\n  train: {data}\n  max_length: 64\n{data_extra}"
        f"training:\n  logging_steps: 1\n  learning_rate: 0.005\n{training}",
        encoding="utf-8",
    )
    return path


def _load_capture_module(folder: Path):
    source = folder / "soup_test_capture.py"
    source.write_text(CAPTURE_SOURCE, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("soup_test_capture", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _segments(ids: list[int], bos: int) -> list[tuple[int, int]]:
    """The (start, end) of each example in one sequence of the batch: a packed sequence holds several,
    each beginning with the bos token the chat template writes. Padding trails the last one."""
    starts = [i for i, tok in enumerate(ids) if tok == bos] or [0]
    return [(start, starts[k + 1] if k + 1 < len(starts) else len(ids)) for k, start in enumerate(starts)]


def _decode_micro(record: dict[str, Any], tokenizer: Any) -> tuple[list[int], list[int]]:
    """The rows one captured forward trained on, in order, and each one's supervised-token count: the
    labels other than -100 in its span, except the sequence's very first label (nothing predicts it)."""
    rows, tokens = [], []
    bos = tokenizer.bos_token_id
    labels_all = record["labels"]
    for b, ids in enumerate(record["ids"]):
        labels = labels_all[b] if labels_all is not None else None
        for start, end in _segments(ids, bos):
            text = tokenizer.decode(ids[start:end])
            markers = MARKER.findall(text)
            if not markers:
                continue  # padding only
            assert len(markers) == 1, f"one example decoded to several markers: {text!r}"
            rows.append(int(markers[0]))
            if labels is not None:
                tokens.append(sum(1 for i in range(max(start, 1), end) if labels[i] != IGNORE))
    return rows, tokens


def _captured(prefix: Path, rank: int, tokenizer: Any, *, first_step: int = 1) -> list[dict[str, Any]]:
    """The captured forwards of one rank as (step, micro, rows, tokens), steps from the optimizer hook."""
    lines = (Path(f"{prefix}.rank{rank}.jsonl")).read_text(encoding="utf-8").splitlines()
    out: list[dict[str, Any]] = []
    for line in lines:
        record = json.loads(line)
        step = first_step + record["steps_done"]
        micro = out[-1]["micro"] + 1 if out and out[-1]["step"] == step else 0
        rows, tokens = _decode_micro(record, tokenizer)
        out.append({"step": step, "micro": micro, "rows": rows, "tokens": tokens})
    return out


def _logged(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(every line of a rewind log, its batch lines as (step, micro, rows, tokens))."""
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    batches = [
        {"step": o["step"], "micro": o["micro"], "rows": o["rows"], "tokens": o["row_tokens"]}
        for o in lines
        if o.get("kind") == "batch"
    ]
    return lines, batches


def _mismatches(captured: list[dict[str, Any]], logged: list[dict[str, Any]]) -> list[str]:
    problems = []
    if len(captured) != len(logged):
        problems.append(f"{len(captured)} forwards captured, {len(logged)} micro-batches logged")
    for c, g in zip(captured, logged, strict=False):
        key = (c["step"], c["micro"])
        if key != (g["step"], g["micro"]):
            problems.append(f"forward at step/micro {key} logged as {(g['step'], g['micro'])}")
        if c["rows"] != g["rows"]:
            problems.append(f"step {key}: trained rows {c['rows']}, log names {g['rows']}")
        if c["tokens"] != g["tokens"]:
            problems.append(f"step {key}: supervised tokens {c['tokens']}, log says {g['tokens']}")
    return problems


def _check(captured: list[dict[str, Any]], logged: list[dict[str, Any]]) -> None:
    assert captured and all(c["rows"] for c in captured), "nothing was captured"
    assert not _mismatches(captured, logged), "\n".join(_mismatches(captured, logged))
    # Control: the comparison catches a log that names the rows of one micro-batch wrongly.
    wrong = [dict(g) for g in logged]
    wrong[-1] = {**wrong[-1], "rows": [(r + 1) for r in wrong[-1]["rows"]]}
    assert _mismatches(captured, wrong)
    # ... and one that credits two rows of a micro-batch with each other's supervised tokens.
    k = next(i for i, g in enumerate(logged) if len(set(g["tokens"])) > 1)
    tokens = list(logged[k]["tokens"])
    a, b = next((i, j) for i in range(len(tokens)) for j in range(i + 1, len(tokens)) if tokens[i] != tokens[j])
    tokens[a], tokens[b] = tokens[b], tokens[a]
    swapped = [dict(g) for g in logged]
    swapped[k] = {**swapped[k], "tokens": tokens}
    assert _mismatches(captured, swapped)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    """The session's tiny Llama (tests/conftest.py), built once for every test file that trains."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture
def train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dir: Path):
    """``train(name, config_path)``: the real pipeline (config → plan → execute) with the installed rewind
    plugin and the capture plugin; returns the capture prefix."""
    import soup_plugin_rewind.plugin as rewind_plugin
    from soup_core.config import load_config
    from soup_core.run import execute, plan_run
    from soup_core.testing import isolated_plugins
    from soup_core.tracker import Tracker

    monkeypatch.setenv("SOUP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    capture = _load_capture_module(tmp_path)
    plugins = isolated_plugins(("rewind", rewind_plugin), ("capture", capture))
    assert not plugins.failures and plugins.plugins["rewind"].status == plugins.plugins["capture"].status == "ok"
    reports: list[str] = []

    def run(name: str, config_path: Path) -> Path:
        prefix = tmp_path / f"capture-{name}"
        monkeypatch.setenv(CAPTURE_ENV, str(prefix))
        config = load_config(config_path, plugins=plugins)
        plan = plan_run(config, plugins=plugins, base_dir=config_path.parent)
        summary = execute(plan, plugins=plugins, report=reports.append, tracker=Tracker())
        assert summary["status"] == "completed", reports
        assert not [m for m in reports if "Rewind" in m], reports  # the recorder never switched off
        return prefix

    yield run
    for handle in capture._HANDLES:  # the global optimizer hook must not outlive the test
        handle.remove()


# -------------------------------------------------------------------------------------------- cases


def test_gradient_accumulation_log_names_the_trained_rows(tmp_path: Path, train, model_dir: Path, tokenizer) -> None:
    # 10 rows in micro-batches of 2: 5 per epoch, so with accumulation 2 every epoch ends on a step of one
    # micro-batch, and the next epoch's first step starts afresh.
    out = tmp_path / "out"
    config = _write_config(
        tmp_path / "soup.yaml",
        model=model_dir,
        data=_write_data(tmp_path / "data.jsonl", 10),
        output=out,
        training="  max_steps: 5\n  batch_size: 2\n  gradient_accumulation_steps: 2\n",
    )
    prefix = train("ga", config)
    lines, logged = _logged(out / "rewind.jsonl")
    assert lines[0]["kind"] == "header" and lines[0]["grad_accum"] == 2
    captured = _captured(prefix, 0, tokenizer)
    _check(captured, logged)
    assert [(c["step"], c["micro"]) for c in captured] == [
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (3, 0),
        (4, 0),
        (4, 1),
        (5, 0),
        (5, 1),
    ]
    assert sorted(r for c in captured[:5] for r in c["rows"]) == list(range(10))  # one whole epoch


def test_packing_log_names_every_row_of_each_packed_sequence(tmp_path: Path, train, model_dir: Path, tokenizer) -> None:
    out = tmp_path / "out"
    config = _write_config(
        tmp_path / "soup.yaml",
        model=model_dir,
        data=_write_data(tmp_path / "data.jsonl", 12),
        output=out,
        data_extra="  packing: true\n",
        training="  max_steps: 3\n  batch_size: 4\n",
    )
    prefix = train("packing", config)
    lines, logged = _logged(out / "rewind.jsonl")
    assert lines[0]["packing"] is True
    captured = _captured(prefix, 0, tokenizer)
    # really packed: one sequence per forward, holding the 4 rows of the micro-batch
    records = [json.loads(line) for line in Path(f"{prefix}.rank0.jsonl").read_text().splitlines()]
    assert all(len(r["ids"]) == 1 for r in records)
    assert all(len(c["rows"]) == 4 for c in captured)
    _check(captured, logged)


def test_resumed_log_continues_from_the_checkpoint(tmp_path: Path, train, model_dir: Path, tokenizer) -> None:
    out = tmp_path / "out"
    data = _write_data(tmp_path / "data.jsonl", 10)
    training = "  max_steps: 4\n  batch_size: 2\n  save_steps: 2\n"
    first = train(
        "first", _write_config(tmp_path / "a.yaml", model=model_dir, data=data, output=out, training=training)
    )
    _, logged_first = _logged(out / "rewind.jsonl")
    captured_first = _captured(first, 0, tokenizer)
    _check(captured_first, logged_first)
    assert [c["step"] for c in captured_first] == [1, 2, 3, 4]

    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").is_file()
    second = train(
        "resumed",
        _write_config(
            tmp_path / "b.yaml",
            model=model_dir,
            data=data,
            output=out,
            training=training + f"  resume_from: {checkpoint}\n",
        ),
    )
    lines, logged = _logged(out / "rewind.jsonl")
    assert not (out / "rewind.jsonl.1").exists()  # continued, not rotated
    kinds = [line["kind"] for line in lines]
    marker = kinds.index("resume")
    assert kinds.count("header") == 1 and kinds.count("resume") == 1
    assert lines[marker]["from_step"] == 2
    before = [g for g in logged if g["step"] <= 2]
    after = logged[len(before) :]
    # lines up to the checkpoint kept as the first run wrote them; its steps 3-4 dropped
    assert before == logged_first[:2] and [line["step"] for line in lines[1:marker]] == [1, 2]
    captured = _captured(second, 0, tokenizer, first_step=3)
    assert [c["step"] for c in captured] == [3, 4]
    _check(captured, after)
    assert all(line["kind"] == "batch" for line in lines[marker + 1 :])


def test_two_process_ddp_logs_name_each_ranks_rows(tmp_path: Path, model_dir: Path, tokenizer) -> None:
    from soup_core.testing import make_distribution, run_soup
    from soup_plugin_rewind import read_log

    site = tmp_path / "site"
    make_distribution(
        site,
        "soup-test-capture",
        entry_points={"capture": "soup_test_capture"},
        modules={"soup_test_capture.py": CAPTURE_SOURCE},
    )
    out = tmp_path / "out"
    config = _write_config(
        tmp_path / "soup.yaml",
        model=model_dir,
        data=_write_data(tmp_path / "data.jsonl", 11),
        output=out,
        training="  max_steps: 3\n  batch_size: 2\n",
    )
    prefix = tmp_path / "capture-ddp"
    env = {
        "SOUP_HOME": str(tmp_path / "home"),
        CAPTURE_ENV: str(prefix),
        "SOUP_LOAD_PLUGINS": "rewind,capture",
        "OMP_NUM_THREADS": "1",
        "SOUP_DEBUG": "1",
    }
    # the launcher passes the environment on to torchrun's ranks, PYTHONPATH (the capture plugin) included
    proc = run_soup(
        ["train", "--config", str(config), "--nproc", "2"], env=env, extra_path=[site], cwd=tmp_path, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Rewind" not in proc.stdout + proc.stderr, proc.stderr[-3000:]

    per_rank = {}
    for rank, name in ((0, "rewind.jsonl"), (1, "rewind.rank1.jsonl")):
        lines, logged = _logged(out / name)
        assert lines[0]["rank"] == rank and lines[0]["world_size"] == 2
        captured = _captured(prefix, rank, tokenizer)
        assert [c["step"] for c in captured] == [1, 2, 3]
        _check(captured, logged)
        per_rank[rank] = captured
    # the ranks trained different rows, and the reader's merged view holds both ranks' rows per step
    assert per_rank[0][0]["rows"] != per_rank[1][0]["rows"]
    log = read_log(out / "rewind.jsonl")
    assert list(log.steps) == [1, 2, 3]
    for step in (1, 2, 3):
        merged = sorted(r.row for r in log.step_rows(step))
        trained = sorted(r for rank in (0, 1) for c in per_rank[rank] if c["step"] == step for r in c["rows"])
        assert merged == trained


def test_marker_decoding_is_independent_of_the_row_order(tokenizer) -> None:
    """The decoder reads rows from the text alone: the same ids give the same rows, in text order, and
    padding or a different encoding of the same rows changes nothing."""
    from soup_core.default_plugins.sft import encode_rows

    rows = _rows(6)
    encoded = encode_rows([rows[4], rows[1]], tokenizer, max_length=64)  # indices restart at 0 here
    pad = tokenizer.pad_token_id
    width = max(len(e["input_ids"]) for e in encoded)
    ids = [e["input_ids"] + [pad] * (width - len(e["input_ids"])) for e in encoded]
    labels = [e["labels"] + [IGNORE] * (width - len(e["labels"])) for e in encoded]
    decoded_rows, tokens = _decode_micro({"ids": ids, "labels": labels}, tokenizer)
    assert decoded_rows == [4, 1]
    assert tokens == [sum(1 for t in e["labels"][1:] if t != IGNORE) for e in encoded]
    packed = {"ids": [sum((e["input_ids"] for e in encoded), [])], "labels": [sum((e["labels"] for e in encoded), [])]}
    assert _decode_micro(packed, tokenizer) == (decoded_rows, tokens)
