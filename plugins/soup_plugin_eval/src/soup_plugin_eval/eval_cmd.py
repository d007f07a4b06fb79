"""``soup eval``: loss and perplexity of one or more targets on held-out rows, side by side; benchmarks through
lm-evaluation-harness with ``--tasks``.

Import-light: typer at module level; the models when the command runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer

from soup_plugin_eval.cli import EXIT_CODES, TARGET_HELP, Fail, Progress, load_target, run_command, status

EVAL_HELP = f"""Loss and perplexity on held-out rows, with exactly the training encoding; key facts in greedy answers \
(--facts); or benchmarks (--tasks).

\b
  soup eval latest --data held_out.jsonl
  soup eval latest --val                            the run's own validation split
  soup eval latest --facts questions.jsonl --json answers.json     share of answers that state their fact
  soup eval out/checkpoint-20 out/checkpoint-40 out --data held_out.jsonl --json scores.json
  soup eval latest --tasks my_task --include-path tasks/    benchmarks: lm-evaluation-harness
  soup eval latest --tasks my_task --include-path tasks/ --base    the base beside the trained model

The rows are read and encoded as the run's task reads and encodes training rows (its formats, chat template, \
data.max_length, train_on_responses_only), so each row's loss is the mean cross-entropy over the same \
supervised tokens training used (for sft, what soup rewind shows for a training row). The loss of the data is \
the mean over all its supervised tokens; perplexity is exp of it. --json writes every row's loss (index: the \
row's position in --data, or in the validation split; file and line: where it came from), to sort the worst \
rows.

--facts FILE: JSON Lines of {{"prompt": ..., "fact": ...}}. Each prompt is one user turn rendered by the run's \
chat template and answered greedily (48 new tokens, batches of 16, as soup quickstart scores its run); a \
question counts when its fact appears in the answer, case-insensitive. --json writes every answer and \
whether it held the fact. Each result is stored with its run and shown by `soup runs show RUN` (summary.eval ...).

{EXIT_CODES}
"""


def _num(value: float) -> Any:
    return value if math.isfinite(value) else None  # strict JSON: a row with no supervised token has no loss


def _source(origin: tuple[str, int] | None) -> dict[str, Any]:
    """A row's data file and line (or record number) for its JSON entry; nothing when unknown."""
    return {} if origin is None else {"file": origin[0], "line": origin[1]}


def _store(spec: Any, key: str, text: str) -> str | None:
    """Record the result in the run's tracker row; a note when it cannot be."""
    from soup_core import Tracker

    if not spec.run_id:
        return f"not stored: {spec.label} names no run"
    tracker = Tracker()
    try:
        if tracker.get_run(spec.run_id) is None:
            return f"not stored: run {spec.run_id} is not in the tracker ({tracker.path})"
        tracker.update_summary(spec.run_id, {key: text})
    except Exception as exc:  # noqa: BLE001 - the scores are printed whatever the tracker says
        return f"not stored in the tracker ({tracker.path}): {exc}"
    return None


def eval_(
    targets: list[str] = typer.Argument(..., metavar="TARGET", help=TARGET_HELP + " Several: side by side."),
    data: Path | None = typer.Option(None, "--data", metavar="FILE", help="Held-out rows in a format the run's "
                                     "task trains on."),
    val: bool = typer.Option(False, "--val", help="Score the run's own validation split (data.val_split)."),
    facts: Path | None = typer.Option(None, "--facts", metavar="FILE", help='Questions with key facts (JSON Lines '
                                      'of {"prompt": ..., "fact": ...}): the share of greedy answers stating them.'),
    json_path: Path | None = typer.Option(None, "--json", metavar="PATH", help="Write the scores and every row's "
                                          "loss as JSON."),
    tasks: str | None = typer.Option(None, "--tasks", metavar="NAME[,NAME]", help="lm-evaluation-harness tasks "
                                     "instead of --data (needs soup-plugin-eval[harness])."),
    include_path: Path | None = typer.Option(None, "--include-path", metavar="DIR", help="A folder of "
                                             "lm-evaluation-harness task YAML files (local tasks)."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="With --tasks: at most this many documents "
                                     "per task."),
    base: bool = typer.Option(False, "--base", help="With --tasks: also score the base model (the first "
                              "target's LoRA adapter turned off), in a column beside the targets."),
    batch_size: int | None = typer.Option(None, "--batch-size", min=1, help="Rows scored together (default 8; "
                                          "with --facts 16, as soup quickstart answers)."),
) -> None:
    """Score trained models on held-out rows (see EVAL_HELP)."""

    def body() -> None:
        if sum([data is not None, val, tasks is not None, facts is not None]) != 1:
            raise Fail("give one of --data FILE, --val, --facts FILE or --tasks NAME[,NAME]", 2)
        if (include_path is not None or limit is not None or base) and tasks is None:
            raise Fail("--include-path, --limit and --base go with --tasks", 2)
        if data is not None and not data.is_file():
            raise Fail(f"--data {data}: no such file")
        if tasks is not None:
            from soup_plugin_eval.harness import run_tasks

            results = run_tasks(targets, [t.strip() for t in tasks.split(",") if t.strip()],
                                include_path=include_path, limit=limit, batch_size=batch_size or 8, base=base)
            _report_tasks(results, json_path)
            return
        if facts is not None:
            from soup_core.default_plugins.transformers import FACTS_BATCH_SIZE

            _answer_facts(targets, facts, json_path, batch_size or FACTS_BATCH_SIZE)
            return
        _score_rows(targets, data, json_path, batch_size or 8)

    run_command(body)


def _score_rows(targets: list[str], data: Path | None, json_path: Path | None, batch_size: int) -> None:
    from soup_core import load_plugins
    from soup_plugin_eval.evaluate import encode, eval_rows, score

    plugins = load_plugins()
    results: list[tuple[Any, Any, str, Any]] = []
    for spec_text in targets:
        spec, loaded = load_target(spec_text)
        rows, what, origin = eval_rows(spec, plugins, data)
        if not rows:
            raise Fail(f"{what}: no rows to score")
        encoded = encode(spec, plugins, rows, loaded.tokenizer)
        scores = score(loaded, encoded, batch_size=batch_size, progress=Progress("scoring", len(encoded)))
        results.append((spec, scores, what, origin))
        del loaded  # one model in memory at a time
    name = "val" if data is None else data.name
    rows = [(spec, [str(len(scores.row_loss)), str(scores.tokens), f"{scores.loss:.4f}", f"{scores.perplexity:.4g}"],
             f"eval {name} @ {spec.weights.name}",
             f"loss {scores.loss:.4f}, perplexity {scores.perplexity:.4g} ({len(scores.row_loss)} rows, "
             f"{scores.tokens} tokens)") for spec, scores, _what, _origin in results]
    _report(f"soup eval: {results[0][2]}" if len({r[2] for r in results}) == 1 else "soup eval",
            ("target", "rows", "tokens", "loss", "perplexity"), rows, json_path, lambda: {"targets": [{
                "target": spec.spec, "label": spec.label, "run_id": spec.run_id, "data": what,
                "rows": len(scores.row_loss), "tokens": scores.tokens, "loss": _num(scores.loss),
                "perplexity": _num(scores.perplexity),
                "row_losses": [{"index": i, "loss": _num(loss), "tokens": n, **_source(origin(i))}
                               for i, (loss, n) in enumerate(zip(scores.row_loss, scores.row_tokens, strict=True))],
            } for spec, scores, what, origin in results]}, allow_nan=False)


def _report(title: str, columns: tuple[str, ...], rows: list[tuple[Any, list[str], str, str]],
            json_path: Path | None, payload: Any, *, allow_nan: bool = True) -> None:
    """One table row per target (its label, then ``cells``), each target's result stored in its run once
    (``key``, ``text``), and ``payload()`` written to ``json_path`` when given."""
    from rich.table import Table

    from soup_core import atomic_write, console

    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column == "target" else "right")
    notes: list[str] = []
    for spec, cells, key, text in rows:
        table.add_row(spec.label, *cells)
        note = _store(spec, key, text)
        if note and note not in notes:
            notes.append(note)
    console.print(table)
    for note in notes:
        status(note)
    if json_path is not None:
        try:
            atomic_write(json_path, json.dumps(payload(), indent=1, allow_nan=allow_nan) + "\n")
        except OSError as exc:
            raise Fail(f"--json {json_path}: {exc}") from None
        status(f"wrote {json_path}")


def _answer_facts(targets: list[str], path: Path, json_path: Path | None, batch_size: int) -> None:
    """Greedy answers of each target to the questions of ``path``; the share that states each key fact."""

    from soup_core.default_plugins import transformers as key_facts

    try:
        questions = key_facts.read_facts(path)
    except key_facts.FactsError as exc:
        raise Fail(f"--facts {exc}") from None
    results: list[tuple[Any, list[dict[str, Any]]]] = []
    for spec_text in targets:
        spec, loaded = load_target(spec_text)
        if loaded.engine != "transformers":
            raise Fail(f"--facts answers with transformers; {spec.label} is an mlx run (soup export it --to peft)")
        if not getattr(loaded.tokenizer, "chat_template", None):
            raise Fail(f"--facts renders each prompt with the run's chat template; {spec.label}'s tokenizer has none")
        answers = key_facts.greedy_answers(loaded.model, loaded.tokenizer, [q.prompt for q in questions],
                                           batch_size=batch_size)
        results.append((spec, key_facts.score_facts(questions, answers)))
        del loaded  # one model in memory at a time
    rows = []
    for spec, scored in results:
        hits, total = key_facts.facts_share(scored)
        rows.append((spec, [str(total), str(hits), f"{hits / total:.0%}"],
                     f"eval facts {path.name} @ {spec.weights.name}", f"{hits}/{total} stated their fact"))
    _report(f"soup eval --facts {path.name}", ("target", "questions", "stated", "share"), rows, json_path,
            lambda: {"targets": [{"target": spec.spec, "label": spec.label, "run_id": spec.run_id, "facts": str(path),
                                  "questions": len(scored), "stated": key_facts.facts_share(scored)[0],
                                  "results": [{"index": i, **r} for i, r in enumerate(scored)]}
                                 for spec, scored in results]})


def _report_tasks(results: list[tuple[Any, dict[str, dict[str, Any]]]], json_path: Path | None) -> None:
    """One row per task and metric, one column per model (``value ± stderr``), side by side; the base (a
    result without a target) first, labelled ``base``."""
    from rich.table import Table

    from soup_core import atomic_write, console

    def label(spec: Any) -> str:
        return "base" if spec is None else spec.label

    table = Table(title="soup eval --tasks (lm-evaluation-harness)")
    table.add_column("task")
    table.add_column("metric")
    for spec, _ in results:
        table.add_column(label(spec), justify="right")
    rows: dict[tuple[str, str], None] = {}  # each (task, metric) in the order the results give them
    for _, per_task in results:
        for task, metrics in per_task.items():
            for metric, value in metrics.items():
                if not metric.endswith("_stderr") and isinstance(value, int | float):
                    rows.setdefault((task, metric))
    for task, metric in rows:
        cells = []
        for _, per_task in results:
            value = per_task.get(task, {}).get(metric)
            err = per_task.get(task, {}).get(f"{metric}_stderr")
            cells.append("-" if not isinstance(value, int | float) else f"{value:.4g}"
                         + (f" ± {err:.2g}" if isinstance(err, int | float) else ""))
        table.add_row(task, metric, *cells)
    for spec, per_task in results:
        if spec is not None:
            _store(spec, f"eval tasks {','.join(per_task)} @ {spec.weights.name}",
                   "; ".join(f"{task} {m} {v:.4g}" for task, ms in per_task.items() for m, v in ms.items()
                             if isinstance(v, int | float) and not m.endswith("_stderr")))
    console.print(table)
    if json_path is not None:
        payload = {"targets": [{"target": "base" if spec is None else spec.spec, "label": label(spec),
                                "run_id": None if spec is None else spec.run_id, "results": per_task}
                               for spec, per_task in results]}
        atomic_write(json_path, json.dumps(payload, indent=1, default=str) + "\n")
        status(f"wrote {json_path}")
