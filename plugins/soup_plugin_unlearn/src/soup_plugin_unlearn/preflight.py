"""Checks of an unlearn config before data or a model are loaded (also under ``--dry-run``).

A parameter the chosen method does not use is refused, not silently ignored (the upstream tool read
``unlearn_alpha: 0`` as 1 and ignored ``target_modules``; here every value set is a value used).
"""

from __future__ import annotations

from typing import Any

from soup_core.contracts import PreflightReport
from soup_plugin_unlearn.fields import DEFAULT_GAMMA, describe, resolved

#: The adapter settings rmu's published recipe (``unlearn_rmu_params: mlp``) has no use for.
LORA_PATHS = ("training.lora.r", "training.lora.alpha", "training.lora.dropout", "training.lora.target_modules")

RETAIN_MISSING = (
    "data.retain is not set: training on the forget loss alone, so nothing holds the rest of the model's "
    "knowledge in place; add data.retain to keep it"
)


def _unused(config: Any) -> list[tuple[str, str]]:
    """(field, the methods that use it) for every method parameter set but not used by the chosen method."""
    t = config.training
    method = t.unlearn_method
    found = []
    if t.unlearn_beta is not None and method == "rmu":
        found.append(("training.unlearn_beta", "npo and simnpo"))
    if t.unlearn_gamma != DEFAULT_GAMMA and method != "simnpo":
        found.append(("training.unlearn_gamma", "simnpo"))
    if t.unlearn_rmu_layer is not None and method != "rmu":
        found.append(("training.unlearn_rmu_layer", "rmu"))
    if t.unlearn_rmu_coeff is not None and method != "rmu":
        found.append(("training.unlearn_rmu_coeff", "rmu"))
    if t.unlearn_rmu_params != "mlp" and method != "rmu":
        found.append(("training.unlearn_rmu_params", "rmu"))
    if t.unlearn_rmu_tokens != "all" and method != "rmu":
        found.append(("training.unlearn_rmu_tokens", "rmu"))
    return found


def mlp_mode(config: Any) -> bool:
    """Whether the run trains rmu's published way: the MLPs of layers l−2..l, no adapter."""
    t = config.training
    return t.unlearn_method == "rmu" and t.unlearn_rmu_params == "mlp"


def _mlp_mode_refusal(config: Any) -> PreflightReport | None:
    from soup_core.config import is_default

    title = "unlearn"
    quant = config.training.quantization
    if quant not in (None, "none"):
        return PreflightReport(
            title,
            refusal=f"training.quantization is {quant}, but rmu with unlearn_rmu_params: mlp (the paper's "
            "recipe) trains the base's own MLP weights, which cannot be trained quantized",
            fix="remove training.quantization, or set training.unlearn_rmu_params: lora to train a LoRA "
            "adapter on the quantized base (departs from the paper)",
        )
    set_lora = [path for path in LORA_PATHS if not is_default(config, path)]
    if set_lora:
        return PreflightReport(
            title,
            refusal=f"{', '.join(set_lora)} set, but rmu with unlearn_rmu_params: mlp (the paper's recipe) "
            "trains the MLP parameters of layers l-2..l directly and adds no adapter",
            fix=f"remove {', '.join(set_lora)}, or set training.unlearn_rmu_params: lora to train through "
            "LoRA (departs from the paper)",
        )
    return None


def check(config: Any) -> PreflightReport:
    """The plan lines for an unlearn run, or a refusal with its fix."""
    title = "unlearn"
    if getattr(config.data, "train", None):
        return PreflightReport(
            title,
            refusal="data.train is set, but task unlearn does not read it: it trains on data.forget "
            "(the rows to forget) and data.retain (the rows to keep)",
            fix="remove data.train (put rows the model must keep in data.retain)",
        )
    if mlp_mode(config):
        refused = _mlp_mode_refusal(config)
        if refused is not None:
            return refused
    elif int(config.training.lora.r) == 0:
        return PreflightReport(
            title,
            refusal="task unlearn trains a LoRA adapter: the starting model (NPO's reference, RMU's frozen "
            "activations, the evaluation baseline) is the base with the adapter switched off, so no second "
            "copy of the model is held; training.lora.r: 0 leaves no adapter to switch off",
            fix="set training.lora.r above 0 (e.g. 8)",
        )
    unused = _unused(config)
    if unused:
        method = config.training.unlearn_method
        listed = "; ".join(f"{path} is used by {users} only" for path, users in unused)
        return PreflightReport(
            title,
            refusal=f"training.unlearn_method is {method}, and {listed}",
            fix="remove " + ", ".join(path for path, _ in unused) + " (or choose the method that uses it)",
        )
    params = resolved(config.training)
    lines = [f"method {describe(params)}"]
    if getattr(config.data, "retain", None) is None:
        lines.append("warning: " + RETAIN_MISSING)
    elif params["alpha"] == 0:
        lines.append("unlearn_alpha is 0: the retain rows are evaluated but not trained on")
    return PreflightReport(title, lines=lines)
