"""Capability probes ask the installed object, never a version number: fed a fake class with or without a
keyword (or a loss type in its source), the answer follows the class — on the same trl version."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from soup_core import probes
from soup_plugin_rl.capabilities import check_needs, find_class, handles_literal, loss_type_value
from soup_plugin_rl.errors import CapabilityError
from soup_plugin_rl.tasks import TASKS, BCOTask, GRPOTask, IPOTask, PPOTask
from soup_plugin_rl.variants import VARIANTS, plan_variant


def config_class(*fields: str, list_loss: bool = False) -> type:
    """A dataclass config with exactly these fields (all optional)."""
    spec = []
    for name in fields:
        if name == "loss_type" and list_loss:
            spec.append((name, list, dataclasses.field(default_factory=lambda: ["sigmoid"])))
        else:
            spec.append((name, object, dataclasses.field(default=None)))
    return dataclasses.make_dataclass("FakeConfig", spec)


def _module_class(tmp_dir, module: str, source: str, name: str) -> type:
    """A class defined in a real source file (the probe reads the defining module's source)."""
    import importlib.util

    path = tmp_dir / f"{module}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, name)


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """Two fake trainer classes: one whose source handles every loss type and has the seam's log-probability
    helper, one that knows "grpo" only and has no helper."""
    tmp = tmp_path_factory.mktemp("fake_trainers")
    every = ", ".join(
        repr(x)
        for x in (
            "grpo",
            "dr_grpo",
            "dapo",
            "bnpo",
            "cispo",
            "sapo",
            "luspo",
            "vespo",
            "sigmoid",
            "ipo",
            "bco_pair",
            "kto",
            "simpo",
        )
    )
    full = _module_class(
        tmp,
        "fake_full_trainer",
        f"""
class FullTrainer:
    LOSSES = ({every})

    def _get_per_token_logps_and_entropies(self):
        raise NotImplementedError
""",
        "FullTrainer",
    )
    bare = _module_class(
        tmp,
        "fake_bare_trainer",
        """
class BareTrainer:
    LOSSES = ("grpo",)
""",
        "BareTrainer",
    )
    yield full, bare
    sys.modules.pop("fake_full_trainer", None)
    sys.modules.pop("fake_bare_trainer", None)


GRPO_BASE = ("beta", "num_generations", "max_completion_length", "num_iterations", "scale_rewards")


def test_accepts_follows_the_class_not_the_version(trainers):
    TrainerWithAllLosses, _ = trainers
    with_kw, without_kw = config_class("loss_type"), config_class("beta")
    assert probes.accepts(with_kw, "loss_type") and not probes.accepts(without_kw, "loss_type")
    needs = IPOTask.trl_needs
    assert check_needs(needs, TrainerWithAllLosses, config_class("beta", "loss_type")).ok
    refused = check_needs(needs, TrainerWithAllLosses, config_class("beta"))
    assert not refused.ok and "does not accept loss_type" in refused.reason


def test_a_loss_type_the_trainer_does_not_know_is_refused(trainers):
    TrainerWithAllLosses, TrainerWithoutSeam = trainers
    needs = BCOTask.trl_needs  # bco_pair
    config = config_class("beta", "loss_type")
    assert handles_literal(TrainerWithAllLosses, "bco_pair") is True
    assert handles_literal(TrainerWithoutSeam, "bco_pair") is False
    assert not check_needs(needs, TrainerWithoutSeam, config).ok
    assert check_needs(needs, TrainerWithAllLosses, config).ok


@pytest.mark.parametrize("name", ["gspo", "dapo", "dr_grpo", "luspo"])
def test_a_grpo_variant_runs_natively_only_where_the_config_takes_its_switches(trainers, name):
    TrainerWithAllLosses, TrainerWithoutSeam = trainers
    variant = VARIANTS[name]
    full = config_class(*GRPO_BASE, *variant.native, "use_bias_correction_kl")
    plan = plan_variant(name, TrainerWithAllLosses, full)
    assert plan.mode == "native"
    assert plan.config_kwargs == {
        **variant.native,
        "scale_rewards": variant.scale_rewards,
        "use_bias_correction_kl": False,
    }
    missing_one = next(iter(variant.native))
    lacking = config_class(*GRPO_BASE, *(k for k in variant.native if k != missing_one))
    plan = plan_variant(name, TrainerWithAllLosses, lacking)
    assert plan.mode == "seam" and missing_one in plan.how
    assert "loss_type" not in plan.config_kwargs  # the seam sets none of trl's switches
    with pytest.raises(CapabilityError, match="_get_per_token_logps_and_entropies"):
        plan_variant(name, TrainerWithoutSeam, lacking)


def test_native_only_variant_is_refused_without_its_switch(trainers):
    TrainerWithAllLosses, TrainerWithoutSeam = trainers
    with pytest.raises(CapabilityError, match="vespo"):
        plan_variant("vespo", TrainerWithAllLosses, config_class(*GRPO_BASE))
    assert plan_variant("vespo", TrainerWithAllLosses, config_class(*GRPO_BASE, "loss_type")).mode == "native"
    # the trainer's source must also know the loss type: the same config, a trainer that does not
    with pytest.raises(CapabilityError, match="loss type 'vespo'"):
        plan_variant("vespo", TrainerWithoutSeam, config_class(*GRPO_BASE, "loss_type"))


def test_dr_grpo_needs_unscaled_advantages(trainers):
    TrainerWithAllLosses, _ = trainers
    no_scaling = config_class("beta", "num_generations", "loss_type")
    with pytest.raises(CapabilityError, match="scale_rewards"):
        plan_variant("dr_grpo", TrainerWithAllLosses, no_scaling)
    # a variant that keeps std-scaled advantages runs without the switch
    assert plan_variant("grpo", TrainerWithAllLosses, no_scaling).mode == "native"


def test_loss_type_takes_the_shape_the_config_declares():
    assert loss_type_value(config_class("loss_type", list_loss=True), "ipo") == ["ipo"]
    assert loss_type_value(config_class("loss_type"), "ipo") == "ipo"


def test_a_class_is_found_where_the_installed_library_keeps_it(monkeypatch):
    class Moved:
        pass

    stable = types.ModuleType("fake_trl")
    experimental = types.ModuleType("fake_trl_experimental_orpo")
    experimental.ORPOTrainer = Moved
    monkeypatch.setitem(sys.modules, "fake_trl", stable)
    monkeypatch.setitem(sys.modules, "fake_trl_experimental_orpo", experimental)
    found, where = find_class("ORPOTrainer", ("fake_trl", "fake_trl_experimental_orpo"))
    assert found is Moved and where == "fake_trl_experimental_orpo"
    stable.ORPOTrainer = type("Promoted", (), {})  # promoted back to the stable API: found there first
    found, where = find_class("ORPOTrainer", ("fake_trl", "fake_trl_experimental_orpo"))
    assert found.__name__ == "Promoted" and where == "fake_trl"
    with pytest.raises(CapabilityError, match="looked for fake_trl.NoSuch"):
        find_class("NoSuch", ("fake_trl", "no_such_module_at_all"))


def test_every_loss_type_the_installed_trl_offers_is_a_variant():
    """The installed GRPOConfig documents its loss types; each one is a variant here (so a new trl loss type
    makes this fail until it is mapped), and there are seven or more variants."""
    import re

    from trl import GRPOConfig

    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    offered = set(re.findall(r"'([a-z_]+)'", help_text.split("Supported values are", 1)[1].split(".")[0]))
    assert {"grpo", "dapo", "dr_grpo", "bnpo"} <= offered
    mapped = {v.native.get("loss_type") for v in VARIANTS.values()}
    assert offered <= mapped, f"trl loss types without a variant: {sorted(offered - mapped)}"
    assert len(VARIANTS) >= 7


def test_installed_trl_probes():
    for task in TASKS:
        if task is not PPOTask:
            result = task.probe()
            assert result.ok, (task.name, result.reason)
    assert "gspo (native)" in GRPOTask.probe().detail
    ppo = PPOTask.probe()
    assert not ppo.ok and "PPOTrainer" in ppo.reason


def test_every_variant_cites_a_paper_and_says_what_it_computes():
    from soup_plugin_rl.variants import SEAM_FORMULAS

    for variant in VARIANTS.values():
        assert variant.paper and variant.computes
        if variant.seam is not None:
            doc = SEAM_FORMULAS[variant.seam].__doc__ or ""
            assert "arXiv" in doc or "BNPO" in doc, variant.name
