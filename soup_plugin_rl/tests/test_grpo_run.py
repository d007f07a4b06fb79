"""GRPO through ``soup train``: a user's reward function from the file the config names, the core's row order
for the prompts of every generation batch, the flight recorder switching itself off with its one line, β
as a live coefficient, and the reference as the base with the adapter disabled."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

REWARD_FILE = """
import json

def seen_rows(completions, row_index, **kwargs):
    with open({log!r}, "a") as fh:
        fh.write(json.dumps(list(row_index)) + "\\n")
    return [float(len(c)) for c in completions]
"""


def test_grpo_with_a_user_reward_uses_the_cores_row_order(rl_run, tmp_path, capsys):
    from soup_core import micro_batches

    log = tmp_path / "rows.jsonl"
    reward = tmp_path / "my_rewards.py"
    reward.write_text(REWARD_FILE.format(log=str(log)))
    result = rl_run(
        "grpo",
        training={
            "max_steps": 3,
            "batch_size": 2,
            "num_generations": 2,
            "max_completion_length": 4,
            "reward_fn": ["length", f"{reward}:seen_rows"],
        },
        rewind=True,
    )
    assert result.code == 0
    trainer = result.trainer
    assert trainer.reward_func_names == ["length", "seen_rows"]
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    expected = micro_batches(8, batch_size=2, epoch=0, seed=42)[:3]
    assert seen == [[row for row in batch for _ in range(2)] for batch in expected]
    # GRPO attributes no loss to a row: no micro-batch events, and the flight recorder says so once
    assert result.events.micro == [] and [s.step for s in result.events.steps] == [1, 2, 3]
    err = capsys.readouterr().err
    assert err.count("Rewind log off: the 'grpo' task") == 1
    assert not (result.output_dir / "rewind.jsonl").exists()


def test_grpo_reference_and_live_beta(rl_run):
    import torch

    from soup_core import SetCoefficient
    from soup_core.default_plugins.transformers import BackendError

    result = rl_run(
        "grpo",
        training={
            "max_steps": 1,
            "batch_size": 2,
            "num_generations": 2,
            "max_completion_length": 4,
            "reward_fn": "length",
        },
    )
    trainer = result.trainer
    model = trainer.model
    assert list(model.peft_config) == ["default"]  # no copy of the adapter: the reference disables it
    assert trainer.rl_reference.startswith("reference: the base with the adapter disabled")
    (inputs,) = trainer._buffered_inputs
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad(), model.disable_adapter():
        base, _, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, inputs["completion_ids"].size(1)
        )
    assert torch.equal(base, inputs["ref_per_token_logps"])
    trainer._soup_apply(SetCoefficient("beta", 0.5))
    assert trainer.beta == 0.5
    with pytest.raises(BackendError):
        trainer._soup_apply(SetCoefficient("beta", -1.0))


def test_dpo_writes_per_pair_losses_to_the_rewind_log(rl_run):
    result = rl_run("dpo", training={"max_steps": 2}, rewind=True)
    assert result.code == 0
    lines = [json.loads(line) for line in (result.output_dir / "rewind.jsonl").read_text().splitlines()]
    batches = [line for line in lines if line["kind"] == "batch"]
    assert [b["step"] for b in batches] == [1, 2]
    assert all(len(b["rows"]) == len(b["row_loss"]) == 2 for b in batches)
    step1 = [s for s in result.events.steps if s.step == 1][0]
    assert sum(batches[0]["row_loss"]) / 2 == pytest.approx(step1.metrics["loss"], rel=1e-6)


def test_the_reward_hack_controller_watches_a_live_grpo_run(rl_run):
    """The plugin's wiring, end to end: the grpo trainer publishes its generations' reward statistics, the
    controller reads them from each optimizer step and writes one telemetry line per step."""
    result = rl_run(
        "grpo",
        training={
            "max_steps": 3,
            "batch_size": 2,
            "num_generations": 4,
            "max_completion_length": 4,
            "reward_fn": "length",
            "reward_hack_mitigation": "log_only",
        },
    )
    assert result.code == 0
    published = [s.metrics for s in result.events.steps]
    assert all(m.get("soup/hack/n", 0) > 0 for m in published)  # real generations' rewards reached the event
    log = (result.output_dir / "mitigation_log.jsonl").read_text()
    lines = [json.loads(line) for line in log.splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]


def test_a_20_step_grpo_run_with_beta_is_neither_stopped_nor_skipped_by_the_watchdog(rl_run):
    """A negative control for the watchdog (on by default): GRPO's loss moves with its KL term, so the task
    gets only the non-finite rule, and a healthy run is left alone."""
    result = rl_run(
        "grpo",
        training={"max_steps": 20, "batch_size": 2, "num_generations": 2, "max_completion_length": 4,
                  "beta": 0.1, "reward_fn": "length"},
    )
    assert result.code == 0 and [e.status for e in result.events.ends] == ["completed"]
    steps = result.events.steps
    assert len(steps) == 20 and not [s.step for s in steps if "update_skipped" in s.metrics]
    assert all("update_ratio" in s.metrics for s in steps)  # the watchdog was on and measured every update
