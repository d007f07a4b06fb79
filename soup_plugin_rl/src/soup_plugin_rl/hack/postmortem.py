"""The plain-language postmortem the controller writes when it stops a run: what was seen, what was
tried, what to change."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from soup_plugin_rl.hack.config import HackSettings

POSTMORTEM_NAME = "reward_hack_postmortem.md"

_DETECTOR_WORDS = {
    "info_rm": "the separation between the best and worst halves of each batch's rewards (InfoRM-style)",
    "rm_ensemble": "the agreement between the reward functions on the same completions (ensemble)",
}
_SIGNAL_WORDS = {
    "info_rm": "reward separation",
    "rm_ensemble": "reward-function disagreement",
    "length_trend": "completion-length growth",
    "repetition": "repeated phrases",
}


@dataclass
class Facts:
    """What the controller knows at the stop."""

    run_id: str
    step: int
    settings: HackSettings
    history: Sequence[dict[str, Any]]  # one per step: step, vote, verdict, beta_after, raw
    baselines: dict[str, float | None]
    rollbacks: list[tuple[int, str]] = field(default_factory=list)  # (step, checkpoint)
    unrecoverable: list[int] = field(default_factory=list)  # steps where no good checkpoint existed
    beta_start: float | None = None
    last_good: str | None = None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def render(f: Facts) -> str:
    """The postmortem text (Markdown)."""
    s = f.settings
    judged = [h for h in f.history if h.get("vote") is not None]
    counts = {v: sum(1 for h in f.history if h.get("verdict") == v) for v in ("ok", "warn", "hack")}
    first_hack = next((h["step"] for h in f.history if h.get("verdict") == "hack"), None)
    last = judged[-1] if judged else {}
    betas = [h["beta_after"] for h in f.history if h.get("beta_after") is not None]
    rewards = [h.get("reward_mean") for h in f.history if h.get("reward_mean") is not None]
    lines = [
        f"# Reward-hack postmortem: run {f.run_id}",
        "",
        f"The reward-hack controller ({s.mitigation}) stopped this run at step {f.step}: the policy kept "
        "scoring in ways the reward should not allow, and the recoveries it tried did not cure it.",
        "",
        "## What was seen",
        "",
        f"- Watched: {_DETECTOR_WORDS.get(s.detector, s.detector)}"
        + (
            f", together with {', '.join(_SIGNAL_WORDS[n] for n in s.active_signals if n != s.detector)}"
            if len(s.active_signals) > 1
            else ""
        )
        + ".",
        "- Healthy baseline (first "
        + (f"{s.baseline_steps} steps" if s.baseline_steps > 1 else "step")
        + "): "
        + ", ".join(f"{_SIGNAL_WORDS[n]} {_num(v)}" for n, v in f.baselines.items())
        + ".",
        f"- Verdicts: {counts['ok']} ok, {counts['warn']} warn, {counts['hack']} hack"
        + (f"; the first hack verdict was at step {first_hack}." if first_hack is not None else "."),
        f"- At the stop the hacking vote was {_pct(last.get('smoothed'))} "
        f"(hack at {_pct(s.hack_at)} and above)"
        + (f"; the detector read {_num(last.get('raw', {}).get(s.detector))}." if last else "."),
    ]
    if len(rewards) >= 2 and rewards[-1] > rewards[0]:
        lines.append(
            f"- The mean reward rose from {_num(rewards[0])} to {_num(rewards[-1])} over the run: "
            "a rising reward while the signal worsens is the usual shape of reward hacking."
        )
    elif len(rewards) >= 2:
        lines.append(f"- The mean reward went from {_num(rewards[0])} to {_num(rewards[-1])} over the run.")
    lines += ["", "## What was tried", ""]
    if betas:
        lines.append(
            f"- The KL coefficient β (how strongly the policy is held to the reference) went from "
            f"{_num(f.beta_start)} to {_num(betas[-1])} (highest {_num(max(betas))}; "
            f"ceiling {_num(s.beta_ceil)})."
        )
    for step, checkpoint in f.rollbacks:
        lines.append(f"- Step {step}: rolled model and optimizer back to {Path(checkpoint).name}.")
    for step in f.unrecoverable:
        lines.append(f"- Step {step}: hacking persisted but there was no good checkpoint to roll back to.")
    lines.append(
        f"- The recoveries allowed (training.reward_hack_max_recoveries = {s.max_recoveries}) "
        f"were spent; hacking persisted for {s.rollback_patience} more step(s), so the run was "
        "stopped."
    )
    lines += [
        "",
        "## What to change",
        "",
        "- Look at the completions with the highest rewards: they usually show the shortcut (a format trick, "
        "padding, a repeated phrase, an answer pattern the reward function accepts without checking).",
        "- Fix the reward function so the shortcut earns nothing, or add a second reward function that "
        "catches it (and watch both with training.reward_hack_detector: rm_ensemble).",
        "- Hold the policy closer to the reference: a higher training.beta, or a higher "
        "training.reward_hack_beta_floor / beta_ceil; a lower training.learning_rate slows the drift.",
    ]
    if f.last_good:
        lines.append(
            f"- The last checkpoint judged healthy is {f.last_good}; start again from it with "
            f"`soup train --resume {f.last_good}` once the reward is fixed."
        )
    lines += [
        "",
        "Every step's signal, verdict, β and action is in mitigation_log.jsonl beside this file.",
        "",
    ]
    return "\n".join(lines)


def write(output_dir: str | Path, facts: Facts) -> Path:
    """Write the postmortem into ``output_dir`` atomically; returns its path."""
    from soup_core import atomic_write
    from soup_core.io import record_output

    record_output(output_dir, POSTMORTEM_NAME)  # listed first: a kill mid-write leaves a file the run owns
    return atomic_write(Path(output_dir) / POSTMORTEM_NAME, render(facts))
