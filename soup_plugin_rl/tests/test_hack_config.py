"""The ``training.reward_hack_*`` fields through the core's real config loader, and the pre-flight check:
types validated, a tunable set for a mode that does not use it refused, a mode set for a task without a
live reward refused, inconsistent values refused, each with its fix.

The test plugin registers what the rl plugin will: :func:`hack.config_fields`, :func:`hack.controllers`,
:func:`hack.preflight`; plus stand-ins for part 1's ``grpo`` task and its ``training.beta`` /
``training.reward_fn`` fields (so these tests do not depend on part 1), and a task ``other`` that honours
every field but has no live reward.
"""

from __future__ import annotations

from typing import Annotated, Any

import pytest
import yaml
from annotated_types import Ge

from soup_core import ConfigError, ConfigField, Support, Task, hookimpl, load_config
from soup_core.testing import isolated_plugins
from soup_plugin_rl import hack
from soup_plugin_rl.hack.config import FIELD_PATHS, TUNABLES, check

MODE = "reward_hack_mitigation"


class _Grpo(Task):
    name = "grpo"
    formats = ("prompt_completion",)


class _Other(Task):
    name = "other"
    formats = ("prompt_completion",)


class HackConfigPlugin:
    SOUP_HOOK_API = (1, 1)

    @hookimpl
    def soup_register_tasks(self) -> list[type]:
        return [_Grpo, _Other]

    @hookimpl
    def soup_register_config_fields(self) -> list[ConfigField]:
        return [
            *hack.config_fields(),
            ConfigField("training.beta", Annotated[float, Ge(0)], 0.1, "stand-in for the rl plugin's β"),
            ConfigField("training.reward_fn", str | list[str], "accuracy", "stand-in: part 1's reward_fn"),
        ]

    @hookimpl
    def soup_register_support(self) -> list[Support]:
        from soup_core.default_plugins.transformers import HONOURED_FIELDS

        own = FIELD_PATHS | {"training.beta", "training.reward_fn"}
        return [Support("transformers", t, HONOURED_FIELDS | own) for t in ("grpo", "other")]

    @hookimpl
    def soup_register_controllers(self) -> list[type]:
        return hack.controllers()

    @hookimpl
    def soup_preflight(self, config: Any):
        return hack.preflight(config)


@pytest.fixture(scope="module")
def plugins():
    return isolated_plugins(("rlhack", HackConfigPlugin()))


@pytest.fixture
def load(tmp_path, plugins):
    def _load(training: dict[str, Any], task: str = "grpo") -> Any:
        path = tmp_path / "soup.yaml"
        data = {"base": "tiny", "task": task, "data": {"train": "train.jsonl"}, "training": training}
        path.write_text(yaml.safe_dump(data), encoding="utf-8")
        return load_config(path, plugins=plugins)

    return _load


def refusal(config: Any) -> str:
    report = hack.preflight(config)
    assert report is not None and report.refusal, report
    return report.refusal + " | fix: " + (report.fix or "")


def test_the_fields_and_the_controller_are_registered(plugins):
    paths = {f.path for f in hack.config_fields()}
    assert paths == FIELD_PATHS and all(p.startswith("training.reward_hack_") for p in paths)
    mode = next(f for f in hack.config_fields() if f.path == "training.reward_hack_mitigation")
    assert mode.default == "off"
    assert plugins.controllers.owner("reward_hack") == "rlhack"
    assert plugins.controllers["reward_hack"].tasks == ("grpo", "ppo")


def test_defaults_say_nothing(load):
    config = load({})
    assert config.training.reward_hack_mitigation == "off" and hack.preflight(config) is None


@pytest.mark.parametrize(
    ("training", "path"),
    [
        ({"reward_hack_mitigation": "halt"}, "training.reward_hack_mitigation"),
        ({"reward_hack_gain": 1.0}, "training.reward_hack_gain"),  # must be above 1
        ({"reward_hack_beta_floor": 0}, "training.reward_hack_beta_floor"),  # β never reaches zero
        ({"reward_hack_dwell": 1.5}, "training.reward_hack_dwell"),
        ({"reward_hack_trip": 1.5}, "training.reward_hack_trip"),
        ({"reward_hack_signals": ["info_rm", "vibes"]}, "training.reward_hack_signals"),
        ({"reward_hack_rollback": "yes"}, "training.reward_hack_rollback"),
        ({"reward_hack_smoothing_window": 1}, "training.reward_hack_smoothing_window"),
    ],
)
def test_bad_values_are_config_errors_naming_the_field(load, training, path):
    with pytest.raises(ConfigError) as info:
        load(training)
    assert path in info.value.render()


def test_a_tunable_set_while_off_is_refused(load):
    text = refusal(load({"reward_hack_kp": 0.9, "reward_hack_trip": 0.4}))
    assert "training.reward_hack_kp is set but training.reward_hack_mitigation is off" in text
    assert "training.reward_hack_trip" in text and "set training.reward_hack_mitigation" in text


@pytest.mark.parametrize(
    ("mode", "tunable", "users"),
    [
        ("log_only", {"reward_hack_trip": 0.4}, "kl_control"),
        ("log_only", {"reward_hack_beta_ceil": 0.5}, "kl_control, pid_lagrangian"),
        ("kl_control", {"reward_hack_kp": 0.9}, "pid_lagrangian"),
        ("kl_control", {"reward_hack_max_recoveries": 4}, "pid_lagrangian"),
        ("pid_lagrangian", {"reward_hack_dwell": 4, "save_steps": 5}, "kl_control"),
    ],
)
def test_a_tunable_for_another_mode_is_refused(load, mode, tunable, users):
    key = next(k for k in tunable if k.startswith("reward_hack_"))
    text = refusal(load({"reward_hack_mitigation": mode, **tunable}))
    assert f"training.{key} is set but mode {mode} does not use it (used by: {users})" in text


def test_a_mode_for_a_task_without_a_live_reward_is_refused(load):
    text = refusal(load({"reward_hack_mitigation": "log_only"}, task="other"))
    assert "acts on tasks with a live reward (grpo, ppo); this run's task is other" in text
    assert "reward_hack_mitigation: off" in text
    config = load({"reward_hack_mitigation": "log_only"}, task="other")
    assert hack.preflight(config, tasks=("other",)).refusal is None


@pytest.mark.parametrize(
    ("training", "needle"),
    [
        ({MODE: "kl_control", "reward_hack_release": 0.3}, "must be below training.reward_hack_trip"),
        ({MODE: "kl_control", "reward_hack_beta_floor": 2.0}, "must be below beta_ceil"),
        ({MODE: "kl_control", "beta": 0.0}, "training.beta is 0.0"),
        ({MODE: "kl_control", "beta": 0.01}, "outside the controller's range [0.02, 1.0]"),
        ({MODE: "pid_lagrangian"}, "training.save_steps is not set"),
        (
            {
                MODE: "pid_lagrangian",
                "save_steps": 5,
                "reward_hack_rollback": False,
                "reward_hack_rollback_patience": 5,
            },
            "reward_hack_rollback_patience is set but",
        ),
        ({MODE: "log_only", "reward_hack_signals": ["repetition"]}, "leaves out the detector"),
        ({MODE: "log_only", "reward_hack_warn_at": 0.5}, "must be below"),
        ({MODE: "log_only", "reward_hack_smoothing_window": 4}, "smoothing is none"),
        ({MODE: "log_only", "reward_hack_detector": "rm_ensemble"}, "reward_fn names 1"),
    ],
)
def test_inconsistent_values_are_refused(load, training, needle):
    assert needle in refusal(load(training))


@pytest.mark.parametrize(
    "training",
    [
        {"reward_hack_mitigation": "log_only"},
        {
            "reward_hack_mitigation": "log_only",
            "reward_hack_detector": "rm_ensemble",
            "reward_fn": ["accuracy", "format"],
            "reward_hack_smoothing": "ema",
            "reward_hack_smoothing_window": 4,
        },
        {"reward_hack_mitigation": "kl_control", "reward_hack_trip": 0.4, "reward_hack_gain": 2.0},
        {"reward_hack_mitigation": "pid_lagrangian", "save_steps": 5, "reward_hack_kp": 1.0},
        {"reward_hack_mitigation": "pid_lagrangian", "reward_hack_rollback": False},
    ],
)
def test_consistent_settings_pass_with_the_plan_lines(load, training):
    config = load(training)
    assert check(config) == []
    report = hack.preflight(config)
    assert report is not None and report.refusal is None and report.lines
    assert report.lines[0].startswith(f"mode {training['reward_hack_mitigation']}")


def test_every_tunable_is_refused_outside_its_modes(load):
    """Exhaustive: each tunable, set to a valid non-default value, under each mode that does not use it."""
    values = {
        "detector": "rm_ensemble",
        "signals": ["info_rm", "repetition"],
        "vote": "max",
        "smoothing": "ema",
        "smoothing_window": 4,
        "baseline_steps": 3,
        "warn_at": 0.05,
        "hack_at": 0.5,
        "beta_floor": 0.05,
        "beta_ceil": 0.9,
        "trip": 0.4,
        "release": 0.05,
        "dwell": 3,
        "release_patience": 4,
        "gain": 2.0,
        "kp": 0.7,
        "ki": 0.2,
        "kd": 0.1,
        "target": 0.2,
        "integral_clamp": 2.0,
        "rollback": False,
        "rollback_patience": 4,
        "max_recoveries": 3,
    }
    assert set(values) == {t.name for t in TUNABLES[1:]}
    for t in TUNABLES[1:]:
        for mode in ("off", "log_only", "kl_control", "pid_lagrangian"):
            if mode in t.modes:
                continue
            training = {MODE: mode, f"reward_hack_{t.name}": values[t.name], "save_steps": 5}
            if t.name == "smoothing_window":
                training["reward_hack_smoothing"] = "ema"
            config = load(training)
            assert any(t.path in p.message for p in check(config)), (t.name, mode)


def test_the_pre_flight_hook_refuses_with_the_reason_and_the_fix(load, plugins):
    """The core calls the hook before any data or model (``soup train`` and ``--dry-run`` alike)."""
    config = load({"reward_hack_mitigation": "kl_control", "reward_hack_kp": 0.9})
    reports = dict(plugins.call_preflight(config))
    assert "reward_hack_kp is set but mode kl_control does not use it" in reports["rlhack"].refusal
    assert "remove training.reward_hack_kp" in reports["rlhack"].fix
    assert "rlhack" not in dict(plugins.call_preflight(load({})))
