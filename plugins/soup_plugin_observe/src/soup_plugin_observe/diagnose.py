"""``soup why``'s rules: from a run's :class:`~soup_plugin_observe.facts.RunFacts` to a verdict in plain words.

A verdict names how the run ended and why (``kind``), the first step where it went wrong, the evidence (each
line naming where it came from) and what to change (a config key and a value to try). Pure Python over what
the run recorded; the rules, one by one, are in the plugin's README.
"""

from __future__ import annotations

import math
import re
import shlex
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from soup_plugin_observe.facts import RunFacts

#: a loss that moved less than this fraction from its start to its end learned nothing
FLAT = 0.01
#: eval loss this fraction above its lowest, and still there at the last eval: over-fitting
OVERFIT_RISE = 0.02
MIN_EVALS = 3
#: words of an out-of-memory failure (host: the allocator or Python; device: CUDA, MPS)
OOM = re.compile(r"out of memory|MemoryError|can't allocate memory|Cannot allocate memory|DefaultCPUAllocator|"
                 r"std::bad_alloc|OutOfMemoryError", re.I)
DEVICE_OOM = re.compile(r"CUDA out of memory|torch\.(?:cuda\.)?OutOfMemoryError|MPS backend out of memory|"
                        r"HIP out of memory|CUDA error: out of memory")
PROGRESS = re.compile(r"^step (\d+)/(\d+)\s.*?(?:([\d,.]+) tok/s)?\s+eta (\S+)", re.M)


@dataclass
class Finding:
    kind: str
    text: str
    step: int | None = None
    fix: str = ""
    key: str | None = None
    value: Any = None


@dataclass
class Verdict:
    run_id: str
    status: str
    kind: str
    headline: str
    first_bad_step: int | None = None
    evidence: list[dict[str, str]] = field(default_factory=list)  # {"source", "text"}
    fix: str = ""
    key: str | None = None
    value: Any = None
    findings: list[Finding] = field(default_factory=list)
    resume: str | None = None
    bundle: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["findings"] = [asdict(f) for f in self.findings]
        return doc


def _finite(series: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(s, v) for s, v in series if v is not None and math.isfinite(v)]


def _ends(values: list[float]) -> tuple[float, float]:
    """The mean of the first and of the last tenth (at least one value each): one noisy batch decides nothing."""
    n = max(1, len(values) // 10)
    return statistics.fmean(values[:n]), statistics.fmean(values[-n:])


def _get(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _num(value: float) -> str:
    return f"{value:.4g}"


def _lr_to_try(config: dict[str, Any], factor: float) -> float:
    lr = _get(config, "training.learning_rate")
    try:
        return float(f"{float(lr) * factor:.3g}")
    except (TypeError, ValueError):
        return 2e-4


def _resume_command(facts: RunFacts) -> str | None:
    said = re.findall(r"^Resume (?:from its last checkpoint )?with: (.+)$", facts.log, re.M)
    if said:
        return said[-1].strip()
    if facts.checkpoints and facts.output_dir:
        return shlex.join(["soup", "train", "--resume", f"{facts.output_dir}/{facts.checkpoints[-1]}"]) + \
            " (with the config and options the run was started with)"
    return None


def _phase(facts: RunFacts) -> str:
    """Where a failed run was: data, model loading, resuming a checkpoint, a step or saving."""
    text = f"{facts.error or ''}\n{facts.traceback}"
    steps = len(facts.series("loss"))
    if "DataError" in text or "EncodingError" in text:
        return "data"
    resuming = _get(facts.config, "training.resume_from")
    if resuming and steps == 0 and re.search(r"_load_from_checkpoint|load_peft_weights|_load_rng_state|"
                                             r"_load_optimizer_and_scheduler|load_adapter", text):
        return "resuming from a checkpoint"
    if re.search(r"save_pretrained|save_model|_save_checkpoint|saving\.py|safetensors.*save|No space left", text):
        return "saving"
    if steps:
        return f"a step (step {facts.series('loss')[-1][0] + 1})"
    if re.search(r"training_step|compute_loss|backward|_inner_training_loop", text):
        return "a step (step 1)"
    if re.search(r"from_pretrained|load_model", text) or ("loading the model" in facts.log and not re.search(
            r"trainable of|LoRA off", facts.log)):
        return "model loading"
    return "setup, before the first step"


def _curve_evidence(facts: RunFacts, verdict: Verdict) -> None:
    loss = _finite(facts.series("loss"))
    if loss:
        first, last = loss[0][1], loss[-1][1]
        lo = min(loss, key=lambda p: p[1])
        verdict.evidence.append({"source": "tracker metrics", "text": f"loss {_num(first)} at step {loss[0][0]} → "
                                 f"{_num(last)} at step {loss[-1][0]} (lowest {_num(lo[1])} at step {lo[0]}; "
                                 f"{len(facts.series('loss'))} steps)"})
    evals = _finite(facts.series("eval_loss"))
    if evals:
        verdict.evidence.append({"source": "tracker metrics", "text": "eval loss " + ", ".join(
            f"{_num(v)} (step {s})" for s, v in evals[:3]) + (f" … {_num(evals[-1][1])} (step {evals[-1][0]})"
                                                              if len(evals) > 3 else "")})


def _origin(trace: str) -> list[str]:
    """Where the first exception of a chain was raised (its last frame and its line), the cause Soup wrapped."""
    first = trace.split("\nThe above exception was the direct cause")[0].split("\nDuring handling of")[0]
    lines = [line.strip() for line in first.strip().splitlines() if line.strip()]
    frames = [line for line in lines if line.startswith("File ")]
    return ([frames[-1]] if frames else []) + (lines[-1:] if lines else [])


def _log_lines(facts: RunFacts, pattern: str, limit: int = 3) -> list[str]:
    return [line.strip() for line in facts.log.splitlines() if re.search(pattern, line)][:limit]


def _completed_findings(facts: RunFacts) -> list[Finding]:
    out: list[Finding] = []
    config = facts.config
    loss = _finite(facts.series("loss"))
    # over-fitting: the eval loss rose from its lowest and stayed up
    evals = _finite(facts.series("eval_loss"))
    if len(evals) >= MIN_EVALS:
        best = min(range(len(evals)), key=lambda i: evals[i][1])
        last, after = evals[-1][1], [v for _, v in evals[best + 1:]]
        # risen, and staying up: the last eval and the mean of those after the lowest (one noisy eval is not it)
        rose = evals[best][1] * (1 + OVERFIT_RISE)
        if len(after) >= 2 and last > rose and statistics.fmean(after) > rose:
            step = evals[best][0]
            keep = f"checkpoint-{step}"
            has = keep in facts.checkpoints
            out.append(Finding(
                "overfitting", f"validation loss rose from {_num(evals[best][1])} at step {step} to {_num(last)} at "
                f"step {evals[-1][0]} while the training loss went on down: the run over-fits from step "
                f"{evals[best + 1][0]}", step=evals[best + 1][0],
                fix=(f"keep {keep} (its lowest validation loss)" if has else
                     f"the lowest validation loss was at step {step} (no checkpoint was saved there: set "
                     f"training.save_steps to the eval steps)") + f"; train for {step} steps: training.max_steps",
                key="training.max_steps", value=step))
    skipped = _log_lines(facts, r"training rows? skipped")
    if not loss and facts.series("grad_norm"):  # steps ran, and none measured a loss: nothing was supervised
        m = re.search(r"data\.max_length=(\d+)", skipped[0]) if skipped else None
        limit = int(m.group(1)) if m else int(_get(config, "data.max_length") or 256)
        said = f" ({skipped[0]})" if skipped else ""
        out.append(Finding("learned_nothing", f"no step measured a loss: every row it trained on was truncated to "
                           f"nothing or skipped{said}, so no weight moved", step=facts.series("grad_norm")[0][0],
                           fix=f"raise data.max_length, to {limit * 4} say, or shorten the prompts",
                           key="data.max_length", value=limit * 4))
    if len(loss) >= 2:
        start, end = _ends([v for _, v in loss])
        if abs(start - end) <= FLAT * abs(start):
            lr = _get(config, "training.learning_rate")
            trainable = facts.summary.get("trainable_parameters")
            if trainable == 0:
                out.append(Finding("learned_nothing", f"the loss stayed at {_num(start)} → {_num(end)}: no weight was "
                                   "trainable", step=loss[0][0], fix="train some weights: set training.lora.r",
                                   key="training.lora.r", value=8))
            else:
                value = _lr_to_try(config, 100.0)
                value = value if value >= 1e-5 else 2e-4  # far too low: the default is the value to try
                why = f"the learning rate {lr} is too low to move the weights" if lr is not None else \
                    "the updates were too small to move the weights"
                extra = f" ({skipped[0]})" if skipped else ""
                out.append(Finding("learned_nothing", f"the loss stayed flat, {_num(start)} → {_num(end)} (less than "
                                   f"{FLAT:.0%} change): {why}{extra}", step=loss[0][0],
                                   fix=f"raise training.learning_rate, to {value:g} say",
                                   key="training.learning_rate", value=value))
    nonfinite = [s for s, v in facts.series("loss") if not math.isfinite(v)]
    skipped_updates = [s for s, v in facts.series("update_skipped") if v and v > 0]
    if nonfinite:
        out.append(Finding("nonfinite_skipped", f"{len(nonfinite)} step(s) had a loss that was not finite, from step "
                           f"{nonfinite[0]} ({', '.join(map(str, nonfinite[:5]))}); the watchdog skipped their "
                           f"updates ({len(skipped_updates)} skipped in all)", step=nonfinite[0],
                           fix=f"find the rows with soup rewind {facts.run_id} --step {nonfinite[0]}; if it recurs, "
                           f"lower training.learning_rate, to {_lr_to_try(config, 0.1):g} say",
                           key="training.learning_rate", value=_lr_to_try(config, 0.1)))
    if facts.quarantine:
        rows = ", ".join(f"row {q.get('row')} at step {q.get('step')}" +
                         (f" ({q.get('file')}:{q.get('line')})" if q.get("file") else "") for q in facts.quarantine[:5])
        first = min(int(q.get("step") or 0) for q in facts.quarantine)
        out.append(Finding("quarantine", f"the spike guard quarantined {len(facts.quarantine)} row(s): {rows}",
                           step=first, fix=f"inspect them (soup rewind {facts.run_id} --step {first}); drop them with "
                           f"soup rewind {facts.run_id} --drop-rows "
                           f"{','.join(str(q.get('row')) for q in facts.quarantine)} --write-data clean.jsonl",
                           key="data.train", value="clean.jsonl"))
    spikes = _spikes(facts)
    if spikes:
        top = spikes[:3]
        out.append(Finding("spikes", f"{len(spikes)} loss spike(s); the highest: " + "; ".join(
            f"step {s.step} loss {_num(s.loss)} ({s.ratio:.1f}× the steps before)" for s in top), step=min(
            s.step for s in spikes), fix=f"see the rows behind them: soup rewind {facts.run_id} --step {top[0].step}; "
            "or let the guard act: training.spike_guard: quarantine", key="training.spike_guard", value="quarantine"))
    return out


def _spikes(facts: RunFacts) -> list[Any]:
    """rewind's spike rule over the step losses (warnings: the non-finite steps are a finding of their own)."""
    return [s for s in facts.spikes() if s.severity == "warning" and s.ratio is not None]


def _rate(facts: RunFacts, now: float) -> str:
    progress = PROGRESS.findall(facts.log)
    if progress:
        step, total, tok, eta = progress[-1]
        rate = f", {tok} tokens/s" if tok else ""
        return f"at step {step} of {total}{rate}, about {eta} left (its last progress line)"
    steps = len(facts.series("loss"))
    if steps and facts.started_at:
        per = (now - facts.started_at) / steps
        return f"{steps} steps so far, {per:.2f} s a step"
    return "no step finished yet"


def diagnose(facts: RunFacts, *, now: float | None = None) -> Verdict:
    """The verdict on ``facts``."""
    now = time.time() if now is None else now
    v = Verdict(run_id=facts.run_id, status=facts.status, kind="", headline="", bundle=facts.bundle)
    error = facts.error or ""
    status = facts.status
    if error:
        v.evidence.append({"source": "tracker row", "text": f"{status}: {error.splitlines()[0]}"})
    if status == "running":
        v.kind = "running"
        v.headline = f"still training (process {facts.pid} on {facts.host}): {_rate(facts, now)}"
    elif status == "crashed":
        steps = facts.series("loss")
        v.kind = "vanished"
        where = f"after step {steps[-1][0]}" if steps else "before its first step"
        v.headline = (f"crashed without a word {where}: its process ended (killed: SIGKILL, or the kernel's "
                      "out-of-memory killer) and recorded nothing")
        v.first_bad_step = steps[-1][0] + 1 if steps else None
        tail = [line for line in facts.log.splitlines() if line.strip()][-2:]
        for line in tail:
            v.evidence.append({"source": "soup-output.log (its last lines)", "text": line.strip()})
        v.resume = _resume_command(facts)
        v.fix = ("if memory ran out (dmesg or journalctl -k say 'Out of memory: Killed process'), check it first "
                 "with soup train --dry-run and lower training.batch_size; then resume" if v.resume else
                 "if memory ran out, lower training.batch_size; then train again")
        v.key, v.value = "training.batch_size", max(1, int(_get(facts.config, "training.batch_size") or 2) // 2)
    elif status == "failed" and OOM.search(f"{error}\n{facts.traceback}"):
        device = bool(DEVICE_OOM.search(f"{error}\n{facts.traceback}"))
        v.kind = "out_of_memory"
        v.headline = f"ran out of {'device (GPU)' if device else 'host'} memory in {_phase(facts)}"
        batch = int(_get(facts.config, "training.batch_size") or 2)
        v.key, v.value = "training.batch_size", max(1, batch // 2)
        v.fix = (f"lower training.batch_size to {max(1, batch // 2)} (raise "
                 "training.gradient_accumulation_steps to keep the batch); soup train --dry-run's memory pre-flight "
                 "says what fits, and training.stream_layers: true streams a model too big to hold")
        steps = facts.series("loss")
        v.first_bad_step = steps[-1][0] + 1 if steps else None
    elif status == "failed":
        phase = _phase(facts)
        v.kind = "crashed"
        v.headline = f"failed in {phase}: {error.splitlines()[0] if error else 'no error was recorded'}"
        steps = facts.series("loss")
        v.first_bad_step = steps[-1][0] + 1 if steps else None
        if "no supervised token left" in error:
            limit = int(_get(facts.config, "data.max_length") or 256)
            v.kind = "learned_nothing"
            v.headline = f"learned nothing: every answer was cut off at data.max_length={limit}, so no row had " \
                         "a token to learn from (every row truncated or skipped); the run was refused"
            v.key, v.value, v.fix = "data.max_length", limit * 4, f"raise data.max_length, to {limit * 4} say"
        elif phase == "resuming from a checkpoint":
            resume = _get(facts.config, "training.resume_from")
            v.key, v.value = "training.resume_from", resume
            v.fix = (f"the checkpoint {resume} cannot be read (a partial copy or a corrupted file): resume from an "
                     "earlier checkpoint-N of the same folder, or train again without --resume")
        elif phase == "data":
            v.fix = "fix the data as the error says (soup train --dry-run checks it without training)"
        else:
            v.fix = "send the crash bundle with a bug report" if facts.bundle else \
                f"make a crash bundle for a bug report: soup bundle {facts.run_id}"
        for line in _origin(facts.traceback):
            v.evidence.append({"source": "traceback (crash bundle)", "text": line})
    elif status == "interrupted":
        steps = facts.series("loss")
        said = _log_lines(facts, r"^Interrupted", 1)
        v.kind = "interrupted"
        v.headline = (f"interrupted after step {steps[-1][0]}" if steps else "interrupted before its first step") + \
            (f": {said[0]}" if said else "")
        for line in said:
            v.evidence.append({"source": "soup-output.log", "text": line})
        v.resume = _resume_command(facts)
        v.fix = f"resume it: {v.resume}" if v.resume else "train again: no checkpoint was saved"
        v.key, v.value = "training.resume_from", (f"{facts.output_dir}/{facts.checkpoints[-1]}"
                                                  if facts.checkpoints and facts.output_dir else None)
    elif status == "stopped" and error.startswith("watchdog:"):
        v.kind = "watchdog"
        rule = "non-finite loss" if "not finite" in error else "divergence"
        m = re.search(r"at \d+ steps in a row \((\d+)-(\d+)", error) or re.search(r"update at step (\d+)", error)
        v.first_bad_step = int(m.group(1)) if m else None
        kept = re.search(r"The output holds (the (?:weights|adapter) from before step \d+)", error)
        v.headline = (f"stopped by the watchdog ({rule} rule) at step "
                      f"{facts.series('loss')[-1][0] if facts.series('loss') else '?'}: the run diverged"
                      + (f"; the output folder holds {kept.group(1)}" if kept else ""))
        v.key, v.value = "training.learning_rate", _lr_to_try(facts.config, 0.01 if rule == "divergence" else 0.1)
        v.fix = f"lower training.learning_rate, to {v.value:g} say, and train again"
    elif status == "stopped":
        v.kind = "stopped"
        v.headline = f"stopped by a controller: {error or 'no reason recorded'}"
    if status == "completed" or v.kind in ("running", "interrupted", "stopped"):
        findings = _completed_findings(facts)
        v.findings = findings
        if status == "completed":
            loss = _finite(facts.series("loss"))
            learned = ""
            if loss:
                start, end = _ends([x for _, x in loss])
                learned = f"loss {_num(start)} → {_num(end)}, the means of its first and last tenth of steps"
            bad = next((f for f in findings if f.kind in ("overfitting", "learned_nothing", "nonfinite_skipped",
                                                          "quarantine", "spikes")), None)
            if bad is None:
                v.kind = "completed"
                v.headline = f"completed and learned: {learned}" if learned else "completed"
                evals = _finite(facts.series("eval_loss"))
                if evals:
                    v.headline += f"; eval loss {_num(evals[0][1])} → {_num(evals[-1][1])}"
            else:
                v.kind = bad.kind
                v.headline = f"completed ({learned}), but {bad.text}" if learned else f"completed, but {bad.text}"
                v.first_bad_step, v.fix, v.key, v.value = bad.step, bad.fix, bad.key, bad.value
    _curve_evidence(facts, v)
    for q in facts.quarantine[:3]:
        v.evidence.append({"source": "quarantine.jsonl", "text": f"row {q.get('row')} quarantined at step "
                           f"{q.get('step')}"})
    if facts.bundle and v.kind in ("crashed", "out_of_memory"):
        v.evidence.append({"source": "crash bundle", "text": facts.bundle})
    return v
