"""Unlearning's defaults on three scales (issue 34, unlearn): npo, simnpo and rmu, each naming nothing but its
method, on the plugin's demo model, on a second small model of another scale, and on SmolLM2-135M-Instruct.

The models: ``demo`` is the bundled demo as ``soup unlearn demo`` writes it (a 4-layer tiny Llama, hidden 128,
taught its 24 invented facts by the demo's own ``learn.yaml``: 150 steps of full fine-tuning). ``second`` is the
same recipe on a tiny Llama of hidden 256 (also 4 layers, built locally from a seed): after the same teaching its
activations at rmu's steered layer are about 8.5 times larger (mean norm 98.4 against 11.6). ``real`` is
``benchmarks/real/unlearn.py``'s capitals test on SmolLM2 (the facts it states, the held-out phrasings).

Measured: greedy recall after unlearning. On the two small models, exact-match recall of the 8 forget and 16
retain facts (the demo's own test, as ``soup unlearn eval --recall`` counts it); on the real model, the share of
the held-out questions the base answered right that are still answered right. Goal: forget <= 10%, retain >= 90%.
The control: the recall before unlearning (100% on the small models), and, on the second model, the other
setting of each default run beside it (``controls``): npo at retain weight 1 (its previous default, which kept 81%
of the retain facts there) and rmu at c = 10 x the mean norm (the default is 5 x, which left 25% of the forget facts
there; 10 x reaches the goal there but kept 44% of SmolLM2's retain facts), so the measure is seen to tell a setting
that fails from one that works on the same model.

Usage: python benchmarks/real/unlearn_scales.py [--models demo,second,real] [--only npo,simnpo,rmu] [--record]
       (--record replaces only the models and methods run, each with its own machine and load average;
        about 15 minutes on 2 CPUs, the real model about 10 of them; offline)
       python benchmarks/real/unlearn_scales.py --smoke   (the same code path, 2 steps, rmu only; CI)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

RESULTS = _common.RESULTS / "real_unlearn_scales.json"
MODELS = ("demo", "second", "real")
METHODS = ("npo", "simnpo", "rmu")
#: The two small models: the demo's (soup_plugin_unlearn.demo.TINY) and one of another scale.
HIDDEN = {"demo": 128, "second": 256}
#: The control on the second model: npo at its previous retain weight 1, rmu at c = CONTROL_SCALE x the norm.
CONTROLS = {"npo": "  unlearn_alpha: 1.0\n", "rmu": "  unlearn_rmu_coeff: {c}\n"}
#: rmu's control multiple: the other one measured (the default, RMU_COEFF_SCALE, is 5).
CONTROL_SCALE = 10.0


def _real_script() -> Any:
    spec = importlib.util.spec_from_file_location("real_unlearn", Path(__file__).with_name("unlearn.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recall(base: Path, run: Path, rows: Path) -> float:
    """Greedy exact match (the continuation of each prompt is its answer), the demo test's measure."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.sft import encode_rows

    tok = AutoTokenizer.from_pretrained(str(base))
    if (run / "adapter_config.json").exists():
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                          str(run))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(run), dtype=torch.float32)
    model.eval()
    examples = encode_rows([json.loads(line) for line in rows.read_text(encoding="utf-8").splitlines()], tok,
                           max_length=64)
    hits = 0
    for e in examples:
        prompt = [t for t, label in zip(e["input_ids"], e["labels"], strict=True) if label == -100]
        answer = [t for t, label in zip(e["input_ids"], e["labels"], strict=True) if label != -100]
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                 dtype=torch.long), max_new_tokens=len(answer), do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        hits += out[0, len(prompt):].tolist() == answer
    return round(hits / len(examples), 4)


def small(name: str, work: Path, env: dict[str, str], methods: list[str], *, smoke: bool) -> dict:
    """The demo's recipe on the tiny Llama of ``HIDDEN[name]``: teach, then each method at its defaults."""
    from soup_core.default_plugins.transformers import tiny_model_dir
    from soup_plugin_unlearn.demo import write_demo

    folder = work / name
    write_demo(folder, base=tiny_model_dir(hidden=HIDDEN[name], layers=4))
    if smoke:  # the same files with 2 steps each
        for path in folder.glob("*.yaml"):
            text = path.read_text(encoding="utf-8").replace("max_steps: 150", "max_steps: 2")
            path.write_text(text.replace("max_steps: 60", "max_steps: 2"), encoding="utf-8")
    _common.say(f"{name}: teaching the facts (hidden {HIDDEN[name]}) ...")
    _common.soup("train", "-c", "learn.yaml", env=env, cwd=folder)
    learned = folder / "learned"
    forget, retain = folder / "forget.jsonl", folder / "retain.jsonl"
    result: dict = {"hidden": HIDDEN[name], "layers": 4,
                    "learned": {"forget_recall": recall(learned, learned, forget),
                                "retain_recall": recall(learned, learned, retain)}, "methods": {}}

    def run(method: str, tag: str, extra: str = "") -> dict:
        text = (folder / f"unlearn-{method}.yaml").read_text(encoding="utf-8")
        text = text.replace(f"unlearned-{method}", f"unlearned-{tag}")
        text = text.replace(f"  unlearn_method: {method}\n", f"  unlearn_method: {method}\n{extra}")
        (folder / f"{tag}.yaml").write_text(text, encoding="utf-8")
        _common.soup("train", "-c", f"{tag}.yaml", env=env, cwd=folder)
        out = folder / f"unlearned-{tag}"
        got = {"forget_recall": recall(learned, out, forget), "retain_recall": recall(learned, out, retain)}
        got["goal_met"] = got["forget_recall"] <= 0.10 and got["retain_recall"] >= 0.90
        params = json.loads((out / "unlearn_eval.json").read_text(encoding="utf-8"))["params"]
        got["settings"] = {k: v for k, v in params.items() if k != "method"}
        _common.say(f"{name} {tag}: {got}")
        return got

    for method in methods:
        result["methods"][method] = run(method, method)
    rmu = result["methods"].get("rmu")
    if rmu is not None:
        result["rmu_mean_norm"] = rmu["settings"]["rmu_start_norm"]
    if name == "second" and not smoke:
        result["controls"] = {}
        for method in (m for m in ("npo", "rmu") if m in methods):
            extra = CONTROLS[method].format(c=round(CONTROL_SCALE * result.get("rmu_mean_norm", 0.0), 4))
            result["controls"][method] = run(method, f"{method}-control", extra)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--only", default=",".join(METHODS))
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="the same code path with 2 steps, rmu only, the second model standing in for the real "
                        "one (no --record)")
    args = parser.parse_args()
    models, methods = args.models.split(","), args.only.split(",")
    for value, known, flag in ((models, MODELS, "--models"), (methods, METHODS, "--only")):
        if not set(value) <= set(known):
            raise SystemExit(f"{flag}: {','.join(value)} is not a list of {', '.join(known)}")
    if args.smoke:
        models, methods = ["second", "real"], ["rmu"]
    work = Path(tempfile.mkdtemp(prefix="soup-unlearn-scales-"))
    env = {**os.environ, "SOUP_HOME": os.environ.get("SOUP_HOME", str(work / "home"))}
    os.environ["SOUP_HOME"] = env["SOUP_HOME"]
    result: dict = {"benchmark": "real_unlearn_scales", "models": {}}
    for name in models:
        if name != "real":
            result["models"][name] = {**small(name, work, env, methods, smoke=args.smoke),
                                      "machine": _common.machine()}
            continue
        real = _real_script()
        if args.smoke:  # the taught second model stands in: the real script's code path, no download, no build
            base, model = str(work / "second" / "learned"), "second (smoke)"
        else:
            base, model = _common.real_folder()
        (work / "real").mkdir()
        result["models"]["real"] = {"model": model, **real.measure(base, work / "real", env, methods,
                                                                    steps=2 if args.smoke else 60, smoke=args.smoke)}
        result["models"]["real"]["machine"] = _common.machine()  # each model's own load average and date
    result.update(_common.machine())
    print(json.dumps(result, indent=2))
    if args.record and not args.smoke:
        _common.record(RESULTS, result, merge=lambda old: merged(old, result))


def merged(old: Any, new: dict) -> dict:
    """``new`` over the recorded result: a run of some models or methods replaces only what it measured."""
    if not isinstance(old, dict) or not isinstance(old.get("models"), dict):
        return new
    models = dict(old["models"])
    for name, got in new["models"].items():
        before = models.get(name) or {}
        for key in ("methods", "controls"):
            if key in before or key in got:
                got[key] = {**before.get(key, {}), **got.get(key, {})}
        models[name] = {**before, **got}
    return {**old, **new, "models": models}


if __name__ == "__main__":
    main()
