"""Nothing accepted and ignored in the rl tasks: a LoRA dropout trl would switch off is refused with trl's
reason (0, what trl does, is accepted; the default is said to be 0 in the plan), trl's
reward, KL, clip and preference-reward metrics reach the tracker (and ``soup runs show``), and a GRPO variant
that trains as another at its settings says so once, naming the setting that makes them differ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

GRPO = {"batch_size": 2, "num_generations": 2, "max_completion_length": 4, "reward_fn": "length"}


def _config(tmp_path: Path, base: Path, task: str, training: dict, rows: list[dict]) -> Path:
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "soup.yaml"
    path.write_text(yaml.safe_dump({"base": str(base), "task": task, "output": str(tmp_path / "out"),
                                    "data": {"train": "train.jsonl"}, "training": training}))
    return path


PAIRS = [{"prompt": "Q?", "chosen": " a", "rejected": " b"}] * 4
PROMPTS = [{"prompt": "Q?", "answer": "4"}] * 4


@pytest.mark.parametrize(("task", "value"), [("dpo", 0.5), ("grpo", 0.05)])  # 0.05 by hand: the run uses 0
def test_a_lora_dropout_trl_switches_off_is_refused_with_its_reason_and_0_accepted(
        tmp_path, dry_run, tiny_model, task, value):
    rows = PAIRS if task == "dpo" else PROMPTS
    code, out = dry_run(_config(tmp_path, tiny_model, task, {"lora": {"dropout": value}}, rows))
    assert code == 1 and f"training.lora.dropout: {value} cannot be honoured by task {task}" in out, out
    assert "disable_dropout" in out and "set training.lora.dropout: 0" in out, out
    code, out = dry_run(_config(tmp_path, tiny_model, task, {"lora": {"dropout": 0.0}}, rows))
    assert code == 0 and "LoRA dropout" not in out, out  # what the run does: accepted, nothing to say
    code, out = dry_run(_config(tmp_path, tiny_model, task, {}, rows))  # default: the plan says it is 0
    assert code == 0 and "LoRA dropout: 0, not the default 0.05 (trl's disable_dropout" in out, out


def test_the_installed_trl_switches_the_lora_dropout_off():
    """What the refusal says, asked of the installed trl and peft: every rl config class sets disable_dropout,
    its trainers call disable_dropout_in_model with it, and that sets a LoRA dropout's p to 0 (control: before
    the call it is the configured 0.5)."""
    import inspect

    import torch
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import disable_dropout_in_model

    from soup_plugin_rl.capabilities import find_pair
    from soup_plugin_rl.tasks import TASKS

    for task in TASKS:
        if task.name == "ppo":
            continue
        trainer_cls, config_cls = find_pair(task.trl_needs.pair)
        assert "disable_dropout" in inspect.signature(config_cls).parameters, task.name
        assert "disable_dropout_in_model" in inspect.getsource(trainer_cls.__init__), task.name

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):  # noqa: ANN001, ANN202
            return self.proj(x)

    model = get_peft_model(Tiny(), LoraConfig(r=2, lora_dropout=0.5, target_modules=["proj"]))
    drops = [m for n, m in model.named_modules() if "lora_dropout" in n and isinstance(m, torch.nn.Dropout)]
    assert drops and all(m.p == 0.5 for m in drops)
    disable_dropout_in_model(model)
    assert all(m.p == 0 for m in drops)


def _note_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "same gradient as" in line]


@pytest.mark.parametrize(("variant", "twin"), [
    ("gspo", "has the same gradient as grpo; set training.grpo_iterations above 1"),
    ("cispo", "has the same gradient as dapo"),
    ("bnpo", "bnpo has the same gradient as dapo (and cispo); raise gradient_accumulation_steps"),
    ("grpo", "variants gspo, sapo have the same gradient as grpo"),
])
def test_a_variant_identical_by_construction_says_so_once(tmp_path, dry_run, tiny_model, variant, twin):
    code, out = dry_run(_config(tmp_path, tiny_model, "grpo", {**GRPO, "grpo_variant": variant}, PROMPTS))
    assert code == 0, out
    notes = _note_lines(out)
    assert len(notes) == 1 and twin in notes[0], out
    # control: the setting the note names makes the variants differ, and the note goes
    differ = {"gradient_accumulation_steps": 2} if variant == "bnpo" else {"grpo_iterations": 2}
    code, out = dry_run(_config(tmp_path, tiny_model, "grpo", {**GRPO, "grpo_variant": variant, **differ},
                                PROMPTS))
    assert code == 0 and _note_lines(out) == [], out


@pytest.mark.parametrize(("task", "keys"), [
    ("dpo", ("rewards/chosen", "rewards/rejected", "rewards/margins")),
    ("grpo", ("reward", "reward_std", "kl", "clip_ratio/region_mean")),
])
def test_the_tracker_records_trls_rl_metrics(rl_run, tmp_path, monkeypatch, task, keys):
    from typer.testing import CliRunner

    from soup_core.cli.main import build_app
    from soup_core.tracker import Tracker

    training = {"max_steps": 2, "logging_steps": 1, **(GRPO if task == "grpo" else {})}
    result = rl_run(task, training=training)
    assert result.code == 0
    trl_logs = {e["step"]: e for e in result.trainer.state.log_history if "loss" in e}
    steps = result.events.steps
    assert [s.step for s in steps] == [1, 2]
    for event in steps:  # each step's value is trl's own for that step (logging every step)
        for key in keys:
            assert event.metrics[key] == pytest.approx(trl_logs[event.step][key], rel=1e-6, abs=1e-9), key
    # the adapter starts at zero, so at step 1 the policy is the reference: implicit rewards and KL are 0
    first = steps[0].metrics
    zero = ("rewards/chosen", "rewards/rejected", "rewards/margins") if task == "dpo" else ("kl",)
    assert all(first[k] == pytest.approx(0.0, abs=1e-6) for k in zero), first
    if task == "dpo":  # control: after one update they are not
        assert steps[1].metrics["rewards/margins"] != pytest.approx(0.0, abs=1e-6)
    run_id = result.events.starts[0].run_id
    recorded = dict(Tracker(tmp_path / "home" / "experiments.db").metrics(run_id))
    assert set(keys) <= set(recorded[2])
    monkeypatch.setenv("SOUP_HOME", str(tmp_path / "home"))
    shown = CliRunner().invoke(build_app(), ["runs", "show", run_id], prog_name="soup", terminal_width=200)
    assert shown.exit_code == 0 and all(f"last {k}" in shown.stdout for k in keys), shown.stdout


# a reward that differs between the completions of a prompt: with equal rewards every advantage is 0, and
# every variant would "train alike" by not training at all
SPREAD_REWARD = """
def spread(completions, **kwargs):
    return [float(sum(map(ord, str(c))) % 7) for c in completions]
"""


def _trained(rl_run, tmp_path: Path, variant: str, **training) -> dict:
    import torch

    reward = tmp_path / "spread_reward.py"
    reward.write_text(SPREAD_REWARD)
    result = rl_run("grpo", training={
        **GRPO, "num_generations": 4, "max_completion_length": 6, "max_steps": 2, "learning_rate": 5e-2,
        "grpo_variant": variant, "beta": 0.0, "reward_fn": f"{reward}:spread", **training})
    assert result.code == 0
    assert result.events.steps[0].metrics["reward_std"] > 0  # the advantages are not all 0
    weights = {n: p.detach().clone() for n, p in result.trainer.model.named_parameters() if p.requires_grad}
    assert any(torch.count_nonzero(w) for n, w in weights.items() if "lora_B" in n)  # it trained
    return weights


def _same(a: dict, b: dict) -> bool:
    """Equal up to rounding: the largest difference is below 1e-3 of the largest weight (gspo reaches
    grpo's gradient through exp and a mean, which rounds differently)."""
    scale = max(float(w.abs().max()) for w in a.values())
    return a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-3 * scale


def test_the_note_is_true_the_variants_train_alike_until_the_ratio_leaves_1(rl_run, tmp_path):
    w = {v: _trained(rl_run, tmp_path, v) for v in ("grpo", "gspo", "sapo", "dapo", "cispo", "bnpo")}
    assert _same(w["grpo"], w["gspo"]) and _same(w["grpo"], w["sapo"])
    assert _same(w["dapo"], w["cispo"]) and _same(w["dapo"], w["bnpo"])
    # control: with two passes per generation the ratio leaves 1, and gspo no longer trains as grpo
    assert not _same(_trained(rl_run, tmp_path, "grpo", grpo_iterations=2),
                     _trained(rl_run, tmp_path, "gspo", grpo_iterations=2))
