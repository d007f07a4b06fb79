"""The reward-hack controller on live runs: the real transformers backend, the tiny model, real trl/peft,
through ``soup train`` (the CLI's own function, so the real tracker path is used).

kl_control runs twice: on the real grpo trainer (its reward function, a user file, returns the scripted
rewards), and, like pid_lagrangian, on a stand-in that can snapshot weights and optimizer state at every
step: a test-only task ``scripted_rl`` whose
trainer is trl's ``SFTTrainer`` with the core's ``SoupTrainerMixin``, listing ``beta`` in
``soup_coefficients`` as the grpo trainer does. Its detector signal is driven by a deterministic scripted
reward sequence — per step, per-completion reward vectors — which it turns into step metrics with the same
:func:`publish_rewards` a real trainer calls, injected into each ``OptimizerStep`` on its way to the
controllers (a thin wrapper around the run's event fan-out). Nothing random decides a verdict, so these
tests cannot flake.

The test plugin registers what the rl plugin will: ``hack.config_fields()``, ``hack.controllers()``
(re-scoped to ``scripted_rl``), ``hack.preflight(config, tasks=...)``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Annotated, Any

import pytest
from annotated_types import Ge

pytestmark = pytest.mark.slow

TASK = "scripted_rl"

# Per-completion rewards of one batch (8 completions, one reward function). Every batch has the same
# within-half spread (population variance 0.01 in each half); only the gap between the halves moves, so
# the info_rm drop from the healthy baseline is 0, 0.2 or 0.5 — far from every threshold.
HEALTHY = [0.0, 0.0, 0.2, 0.2, 0.8, 0.8, 1.0, 1.0]  # gap 0.8
MIDDLING = [0.08, 0.08, 0.28, 0.28, 0.72, 0.72, 0.92, 0.92]  # gap 0.64: drop 0.2 (between the bands)
HACKED = [0.6, 0.6, 0.8, 0.8, 1.0, 1.0, 1.2, 1.2]  # gap 0.4: drop 0.5, and the mean reward rises


# ------------------------------------------------------------------------------------ the test plugin


class ScriptedEvents:
    """The run's event fan-out, with each step's scripted reward statistics added to its metrics."""

    def __init__(self, inner: Any, script: dict[int, list[float]]) -> None:
        self._inner, self._script = inner, script

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def optimizer_step(self, event: Any) -> Any:
        from soup_plugin_rl.hack import publish_rewards

        metrics = dict(event.metrics)
        rewards = self._script.get(event.step)
        if rewards is not None:
            publish_rewards({"scripted": rewards}, metrics=metrics)
        return self._inner.optimizer_step(event._replace(metrics=metrics))


def make_plugin(script: dict[int, list[float]], trainers: list[Any]) -> Any:
    from soup_core import ConfigField, Support, Task, hookimpl
    from soup_plugin_rl import hack

    class ScriptedTask(Task):
        name = TASK
        description = "test only: sft with a live beta coefficient and scripted rewards"
        formats = ("chat",)

        def encode(self, rows, tokenizer, config):
            from soup_core.default_plugins.sft import encode_rows

            return encode_rows(rows, tokenizer, max_length=int(config.data.max_length))

        def build(self, backend, setup):
            from peft import get_peft_model_state_dict
            from trl import SFTTrainer

            from soup_core.default_plugins.transformers import RowCollator, SoupTrainerMixin, datasets_for

            class ScriptedTrainer(SoupTrainerMixin, SFTTrainer):
                soup_coefficients = ("beta",)

                def training_step(self, model, inputs, num_items_in_batch=None):
                    step = self.state.global_step + 1
                    if step not in self.beta_used:  # the first micro-batch of the step: what it starts from
                        self.beta_used[step] = self.beta
                        weights = get_peft_model_state_dict(model)
                        self.snapshots[step] = {
                            "weights": {k: v.detach().clone() for k, v in weights.items()},
                            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                            "same_params": {id(p) for g in self.optimizer.param_groups for p in g["params"]}
                            == {id(p) for p in model.parameters() if p.requires_grad},
                        }
                    return super().training_step(model, inputs, num_items_in_batch)

            train, val = datasets_for(self, setup)
            trainer = ScriptedTrainer(
                model=setup.model,
                args=setup.args,
                train_dataset=train,
                eval_dataset=val,
                data_collator=RowCollator(pad_token_id=setup.tokenizer.pad_token_id, packing=setup.packing),
                processing_class=setup.tokenizer,
            )
            trainer.beta = float(setup.ctx.config.training.beta)
            trainer.beta_used, trainer.snapshots = {}, {}
            trainer.soup_attach(setup)
            setup.ctx.events = ScriptedEvents(setup.ctx.events, script)
            trainers.append(trainer)
            return trainer

    controller = hack.controllers()[0]
    scoped = type("ScriptedRewardHackController", (controller,), {"tasks": (TASK,)})

    class Plugin:
        SOUP_HOOK_API = (1, 1)

        @hookimpl
        def soup_register_tasks(self):
            return [ScriptedTask]

        @hookimpl
        def soup_register_config_fields(self):
            beta = ConfigField("training.beta", Annotated[float, Ge(0)], 0.1, "stand-in: part 1's β")
            return [*hack.config_fields(), beta]

        @hookimpl
        def soup_register_support(self):
            from soup_core.default_plugins.transformers import HONOURED_FIELDS

            fields = (HONOURED_FIELDS - {"data.packing"}) | hack.FIELD_PATHS | {"training.beta"}
            return [Support("transformers", TASK, fields)]

        @hookimpl
        def soup_register_controllers(self):
            return [scoped]

        @hookimpl
        def soup_preflight(self, config):
            return hack.preflight(config, tasks=(TASK,))

    return Plugin()


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def train(tmp_path: Path, tiny_model: Path, torch_one_thread, run_training):
    """``train(script, training)`` → (trainer, output dir, tracker record)."""

    def _train(script: dict[int, list[float]], training: dict[str, Any]):
        from soup_core import Tracker
        from soup_core.testing import write_jsonl

        rows = [
            {
                "messages": [
                    {"role": "user", "content": f"what is {i} plus {i}?"},
                    {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
                ]
            }
            for i in range(16)
        ]
        config = {
            "base": str(tiny_model),
            "task": TASK,
            "output": str(tmp_path / "out"),
            "data": {"train": str(write_jsonl(tmp_path / "train.jsonl", rows)), "max_length": 64},
            "training": {"batch_size": 2, "logging_steps": 1, "learning_rate": 5e-3, "beta": 0.1, **training},
        }
        trainers: list[Any] = []
        run = run_training(config, plugins=[("rlhack", make_plugin(script, trainers))], installed=False)
        assert len(trainers) == 1
        return trainers[0], tmp_path / "out", Tracker().get_run(run.run_id)

    return _train


def log_of(out: Path) -> list[dict[str, Any]]:
    text = (out / "mitigation_log.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


# ------------------------------------------------------------------------------------------ kl_control


def test_kl_control_steers_beta_on_the_live_trainer_along_the_laws_sequence(train):
    script = {1: HEALTHY, 2: HEALTHY, 3: HACKED, 4: HACKED, 5: HACKED, 6: HACKED, 7: MIDDLING}
    script.update({s: HEALTHY for s in range(8, 14)})
    trainer, out, record = train(
        script,
        {
            "max_steps": 13,
            "reward_hack_mitigation": "kl_control",
            "reward_hack_dwell": 2,
            "reward_hack_release_patience": 2,
            "reward_hack_gain": 2.0,
            "reward_hack_beta_floor": 0.025,
            "reward_hack_beta_ceil": 0.4,
        },
    )
    assert record.status == "completed" and trainer.state.global_step == 13
    # The law by hand (trip 0.3, release 0.1, dwell 2, patience 2, gain 2, [0.025, 0.4]); drops per step:
    # 1 baseline · 2 ok 0 · 3 0.5 dwell 1 · 4 0.5 dwell 2 → trip ×2 · 5, 6 0.5 tripped ×2 (ceiling at 6) ·
    # 7 0.2 hold (counts reset) · 8 release 1 · 9 release 2 → ÷2 · 10, 11 → ÷2 · 12, 13 → ÷2
    after = [0.1, 0.1, 0.1, 0.2, 0.4, 0.4, 0.4, 0.4, 0.2, 0.2, 0.1, 0.1, 0.05]
    # β each step of the live trainer trained with: the one set after the step before
    assert trainer.beta_used == dict(zip(range(1, 14), [0.1, *after[:-1]], strict=True))
    assert trainer.beta_used[1] > 0 and trainer.beta == 0.05
    log = log_of(out)
    assert [r["beta_after"] for r in log] == after
    assert [r["verdict"] for r in log] == ["baseline", "ok"] + ["hack"] * 4 + ["warn"] + ["ok"] * 6
    assert [r["step"] for r in log if r["action"] == "set_beta"] == [4, 5, 9, 11, 13]
    assert log[2]["reward_mean"] > log[1]["reward_mean"]  # the hacked batches score higher
    assert not (out / "reward_hack_postmortem.md").exists()


SCRIPTED_REWARD = """
SCRIPT = {script!r}
calls = []


def scripted(completions, **kwargs):
    calls.append(len(completions))
    return list(SCRIPT[len(calls)])
"""


def test_kl_control_steers_beta_of_a_live_grpo_run(rl_run, tmp_path):
    """The same law on the real grpo trainer: its reward function (a user file) returns the scripted
    rewards of each generation, the trainer publishes them, the controller sets β, and every later step's
    loss is computed with the β the law predicts."""
    script = {1: HEALTHY, 2: HEALTHY, 3: HACKED, 4: HACKED, 5: HACKED, 6: HACKED, 7: MIDDLING}
    script.update({s: HEALTHY for s in range(8, 14)})
    reward = tmp_path / "scripted_rewards.py"
    reward.write_text(SCRIPTED_REWARD.format(script=script), encoding="utf-8")
    result = rl_run(
        "grpo",
        training={
            "max_steps": 13,
            "batch_size": 2,
            "num_generations": 4,  # 8 completions a step: one scripted vector
            "max_completion_length": 4,
            "beta": 0.1,
            "reward_fn": f"{reward}:scripted",
            "reward_hack_mitigation": "kl_control",
            "reward_hack_dwell": 2,
            "reward_hack_release_patience": 2,
            "reward_hack_gain": 2.0,
            "reward_hack_beta_floor": 0.025,
            "reward_hack_beta_ceil": 0.4,
        },
    )
    assert result.code == 0 and result.trainer.state.global_step == 13
    after = [0.1, 0.1, 0.1, 0.2, 0.4, 0.4, 0.4, 0.4, 0.2, 0.2, 0.1, 0.1, 0.05]  # as on the stand-in above
    assert [call["beta"] for call in result.calls] == [0.1, *after[:-1]]  # β each live step trained with
    assert result.trainer.beta == 0.05
    log = log_of(result.output_dir)
    assert [r["beta_after"] for r in log] == after
    assert [r["verdict"] for r in log] == ["baseline", "ok"] + ["hack"] * 4 + ["warn"] + ["ok"] * 6


# ------------------------------------------------------------------------------------------ pid_lagrangian


def test_pid_lagrangian_rolls_a_live_grpo_run_back_then_stops_it(rl_run, tmp_path):
    """The rollback and the stop on the real grpo trainer (exactness of the restored state: the stand-in
    test below, which snapshots every step)."""
    from soup_core import Tracker

    script = {1: HEALTHY, 2: HEALTHY, 3: HEALTHY}
    script.update({s: HACKED for s in range(4, 21)})
    reward = tmp_path / "scripted_rewards.py"
    reward.write_text(SCRIPTED_REWARD.format(script=script), encoding="utf-8")
    result = rl_run(
        "grpo",
        training={
            "max_steps": 20,
            "save_steps": 2,
            "batch_size": 2,
            "num_generations": 4,
            "max_completion_length": 4,
            "beta": 0.1,
            "reward_fn": f"{reward}:scripted",
            "reward_hack_mitigation": "pid_lagrangian",
            "reward_hack_rollback_patience": 2,
            "reward_hack_max_recoveries": 2,
        },
    )
    out = result.output_dir
    trainer = result.trainer
    assert result.code == 0 and trainer.state.global_step == 9 and trainer.soup_stop_reason
    assert trainer.soup_rollbacks == [str(out / "checkpoint-2")] * 2
    assert [(r["step"], r["action"]) for r in log_of(out) if r["action"] in ("rollback", "stop")] == [
        (5, "rollback"),
        (7, "rollback"),
        (9, "stop"),
    ]
    (record,) = Tracker(tmp_path / "home" / "experiments.db").list_runs()  # rl_run's SOUP_HOME
    assert record.status == "stopped" and "reward hacking persisted" in (record.error or "")
    assert (out / "reward_hack_postmortem.md").exists()


def test_pid_lagrangian_rolls_back_exactly_then_stops_with_a_postmortem(train, torch_equal):
    from safetensors.torch import load_file

    torch, equal_state = torch_equal
    script = {1: HEALTHY, 2: HEALTHY, 3: HEALTHY}
    script.update({s: HACKED for s in range(4, 21)})
    trainer, out, record = train(
        script,
        {
            "max_steps": 20,
            "save_steps": 2,
            "reward_hack_mitigation": "pid_lagrangian",
            "reward_hack_rollback_patience": 2,
            "reward_hack_max_recoveries": 2,
        },
    )
    # 1 baseline, 2–3 ok; 4–5 hack → roll back to checkpoint-2 (checkpoint-4 was saved at a hack step);
    # 6–7 hack → roll back again; 8–9 hack → recoveries spent: stop at step 9
    checkpoint = out / "checkpoint-2"
    assert trainer.soup_rollbacks == [str(checkpoint)] * 2
    assert trainer.state.global_step == 9 and trainer.soup_stop_reason
    assert record.status == "stopped"
    assert "reward hacking persisted after 2 recovery attempt(s)" in record.error
    assert [(r["step"], r["action"]) for r in log_of(out) if r["action"] in ("rollback", "stop")] == [
        (5, "rollback"),
        (7, "rollback"),
        (9, "stop"),
    ]

    saved = load_file(checkpoint / "adapter_model.safetensors")
    saved_optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    for step in (6, 8):  # the steps right after each rollback start from checkpoint-2, bit for bit
        snap = trainer.snapshots[step]
        assert snap["weights"].keys() == saved.keys() and len(saved) > 0
        assert all(torch.equal(snap["weights"][k], saved[k]) for k in saved), step
        assert equal_state(snap["optimizer"]["state"], saved_optimizer["state"]), step
        assert snap["same_params"]  # the optimizer still updates the model's own parameters
    # Controls: the weights the rollback replaced, and those trained on from the checkpoint, differ from it
    for step in (5, 7, 9):
        weights = trainer.snapshots[step]["weights"]
        assert any(not torch.equal(weights[k], saved[k]) for k in saved), step
    assert not equal_state(trainer.snapshots[5]["optimizer"]["state"], saved_optimizer["state"])

    text = (out / "reward_hack_postmortem.md").read_text(encoding="utf-8")
    assert "stopped this run at step 9" in text and "## What to change" in text
    assert "Step 5: rolled model and optimizer back to checkpoint-2" in text
    assert "The mean reward rose" in text and str(checkpoint) in text
    assert str(out / "reward_hack_postmortem.md") in record.error


@pytest.fixture
def torch_equal():
    import torch

    def equal_state(a: dict, b: dict) -> bool:
        if a.keys() != b.keys() or not a:
            return False
        for key in a:
            x, y = a[key], b[key]
            if x.keys() != y.keys():
                return False
            for name in x:
                u, v = x[name], y[name]
                same = torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v
                if not same:
                    return False
        return True

    return torch, equal_state
