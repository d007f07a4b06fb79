"""The unlearn task's config fields, defaults and support-table row. Import-light: the pydantic-built types
are named as ``"module:attr"`` (in :mod:`soup_plugin_unlearn.field_types`), imported when a config is read.

Every default is written here once and shown by ``soup plugins list`` / the config docs through the field
descriptions. ``unlearn_alpha: 0`` means exactly zero: the retain term is not computed at all.
"""

from __future__ import annotations

from typing import Any, Literal

from soup_core.contracts import ConfigField

# the (transformers, sft) row; light to import
from soup_core.default_plugins.transformers import HONOURED_FIELDS as SFT_HONOURED

TASK = "unlearn"
METHODS = ("npo", "simnpo", "rmu")

#: β when ``training.unlearn_beta`` is not set: NPO's paper value, and SimNPO's (Fan et al., 2024).
DEFAULT_BETA = {"npo": 0.1, "simnpo": 2.5}
#: α when ``training.unlearn_alpha`` is not set: 2 for npo, 1 for simnpo; for rmu 100, the default of Li et al.'s
#: (2024, WMDP) reference code. npo at 1 (NPO+RT's weight) kept only 81% of the retain facts on a second 4-layer
#: model (hidden 256), against 100% at 2, which also holds on the demo and SmolLM2 (README); rmu's paper values
#: follow no model-size rule (1200 for Zephyr-7B, 1600 for Mixtral-8x7B), and 1200 held the demo's forget recall at
#: 100% for every c measured.
DEFAULT_ALPHA = {"npo": 2.0, "simnpo": 1.0, "rmu": 100.0}
DEFAULT_GAMMA = 0.0
#: RMU's steering coefficient when ``unlearn_rmu_coeff`` is unset: c = RMU_COEFF_SCALE × the mean norm of the
#: steered layer's output on the forget rows under the starting model (Adaptive RMU's rule, Dang et al., 2025, whose
#: published scale is 5). c must be large against the activations it replaces, and a fixed c (the paper's 6.5 for
#: Zephyr-7B, 300 for Mixtral) is a different multiple of that norm for every model and layer. 5 reaches the goal on
#: the demo and on SmolLM2-135M (0% forget, 97% retain), where 7.5 and 10 kept only 68% and 44% of the retain facts;
#: a second 4-layer model with 8.5 times larger activations kept 25% of its forget facts at 5 (0% at 10, or at 5
#: with α 10): no multiple measured works on all three; the README gives each model's setting.
RMU_COEFF_SCALE = 5.0
#: How many forget rows (in file order) that mean norm is measured on.
RMU_NORM_ROWS = 64
#: What RMU trains: ``mlp`` = the MLP parameters of layers l−2..l (the paper), ``lora`` = a LoRA adapter.
RMU_PARAMS = ("mlp", "lora")
#: Where RMU averages its two terms: ``all`` = every (non-padding) token (the reference code), ``answer`` =
#: only the positions that predict a supervised token.
RMU_TOKENS = ("all", "answer")

_TYPES = "soup_plugin_unlearn.field_types:"

FIELDS: tuple[ConfigField, ...] = (
    ConfigField(
        "data.forget",
        str | None,
        None,
        "Rows to forget (task unlearn, required there): a .jsonl/.json/.csv file or a folder, in any core "
        "format (chat, alpaca, prompt/completion, text). Relative to the config's folder.",
    ),
    ConfigField(
        "data.retain",
        str | None,
        None,
        "Rows to keep (task unlearn, optional): the retain loss is computed on them. Without it the run "
        "trains on the forget loss alone (a warning says so).",
    ),
    ConfigField(
        "training.unlearn_method",
        Literal["npo", "simnpo", "rmu"],
        "npo",
        "Unlearning objective: npo (negative preference optimisation against the starting model), simnpo "
        "(length-normalised, no reference) or rmu (steer one layer's activations to a random direction).",
    ),
    ConfigField(
        "training.unlearn_alpha",
        _TYPES + "NonNegativeFloatOrNone",
        None,
        "Weight of the retain loss (cross-entropy for npo/simnpo, activation distance for rmu). Unset: 2 for "
        "npo, 1 for simnpo, 100 for rmu (the default of Li et al.'s 2024 reference code). 0 trains on the forget "
        "loss alone: the retain term is not computed.",
    ),
    ConfigField(
        "training.unlearn_beta",
        _TYPES + "PositiveFloatOrNone",
        None,
        "β of npo and simnpo (the inverse temperature of the sigmoid). Unset: 0.1 for npo, 2.5 for simnpo.",
    ),
    ConfigField(
        "training.unlearn_gamma",
        float,
        DEFAULT_GAMMA,
        "γ of simnpo, the paper's reward margin: L = −log σ(−(β/|y|)·log π(y|x) − γ). Default 0. "
        "Earlier versions computed −log σ(−β·(log π/|y| − γ_old)); convert with γ = −β·γ_old.",
    ),
    ConfigField(
        "training.unlearn_rmu_layer",
        _TYPES + "LayerIndexOrNone",
        None,
        "rmu: the decoder layer (0-based) whose output is steered. Unset: the middle one (layers // 2).",
    ),
    ConfigField(
        "training.unlearn_rmu_coeff",
        _TYPES + "PositiveFloatOrNone",
        None,
        "rmu: the steering coefficient c; forget activations are pushed toward c·u, u a fixed random unit "
        "vector drawn from training.seed. Unset: 5 × the mean norm of the steered layer's output on the "
        "first 64 forget rows under the starting model (Adaptive RMU, Dang et al., 2025), measured before "
        "the first step.",
    ),
    ConfigField(
        "training.unlearn_rmu_params",
        Literal["mlp", "lora"],
        "mlp",
        "rmu: what trains. mlp (the paper): only the MLP parameters of layers l−2..l, l the steered layer, "
        "no adapter (training.lora.* and quantization are refused). lora: a LoRA adapter as training.lora "
        "configures it (departs from the paper).",
    ),
    ConfigField(
        "training.unlearn_rmu_tokens",
        Literal["all", "answer"],
        "all",
        "rmu: the tokens both terms average over. all (the reference code): every non-padding token of a "
        "row. answer: only the positions that predict a supervised token (departs from the paper).",
    ),
    ConfigField(
        "training.unlearn_eval_steps",
        _TYPES + "StepCountOrNone",
        None,
        "Measure forget-set and retain-set loss every N optimizer steps (always at the start and the end).",
    ),
)

#: The core fields the unlearn trainer honours (a subset of the sft row: no data.train, no packing, no
#: training.eval_steps — evaluation is the forget/retain measurement, paced by unlearn_eval_steps).
CORE_FIELDS: frozenset[str] = frozenset(SFT_HONOURED) - {"data.train", "data.packing", "training.eval_steps"}

HONOURED: frozenset[str] = CORE_FIELDS | {f.path for f in FIELDS}


def resolved(training: Any) -> dict[str, Any]:
    """The method's parameters with every default filled in (what the trainer uses and the plan prints)."""
    method = str(training.unlearn_method)
    alpha = training.unlearn_alpha
    out: dict[str, Any] = {"method": method, "alpha": float(DEFAULT_ALPHA[method] if alpha is None else alpha)}
    if method in DEFAULT_BETA:
        beta = training.unlearn_beta
        out["beta"] = float(DEFAULT_BETA[method] if beta is None else beta)
    if method == "simnpo":
        out["gamma"] = float(training.unlearn_gamma)
    if method == "rmu":
        out["rmu_layer"] = training.unlearn_rmu_layer  # None: the middle layer, known once the model is
        coeff = training.unlearn_rmu_coeff  # None: scaled to the model, measured before the first step
        out["rmu_coeff"] = None if coeff is None else float(coeff)
        out["rmu_params"] = str(training.unlearn_rmu_params)
        out["rmu_tokens"] = str(training.unlearn_rmu_tokens)
    return out


def describe(params: dict[str, Any]) -> str:
    """One line: ``npo: β=0.1, retain weight α=1.0``."""
    parts = []
    if "beta" in params:
        parts.append(f"β={params['beta']:g}")
    if "gamma" in params:
        parts.append(f"γ={params['gamma']:g}")
    if "rmu_coeff" in params:
        layer = params.get("rmu_layer")
        coeff = params["rmu_coeff"]
        c = f"{RMU_COEFF_SCALE:g}×mean norm" if coeff is None else f"{coeff:g}"
        parts.append(f"layer {'middle' if layer is None else layer}, c={c}")
        trains = "MLPs of layers l-2..l" if params.get("rmu_params") == "mlp" else "a LoRA adapter"
        parts.append(f"trains {trains}, averaged over {params.get('rmu_tokens')} tokens")
    parts.append(f"retain weight α={params['alpha']:g}")
    return f"{params['method']}: " + ", ".join(parts)
