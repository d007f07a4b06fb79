"""The bundled demo: invented facts to forget and to keep, and the configs that first teach them to a tiny
model and then make it forget one set. Written by ``soup unlearn demo``; the docs and a test run it.

Both data files are prompt/completion JSON Lines, a format the core reads (``data.format: auto`` detects
it). Import-light: building the tiny base model imports torch, inside :func:`write_demo`.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

from soup_core import atomic_write

DATA_FILES = ("forget.jsonl", "retain.jsonl")
#: The tiny model the demo teaches: wide enough to memorise 24 facts in well under a minute on a CPU, and
#: deep enough (4 layers) for rmu's recipe (steer layer l, train the MLPs of layers l-2..l).
TINY = {"hidden": 128, "layers": 4}

#: Each method at its documented defaults: only the method is named.
METHOD_SETTINGS = {
    "npo": "  unlearn_method: npo\n",
    "simnpo": "  unlearn_method: simnpo\n",
    "rmu": "  unlearn_method: rmu\n",
}
#: NPO at its defaults on the demo needs them: at 40 steps the retain recall was still 44% (60: 100%)
DEMO_STEPS = 60
#: The adapter of the LoRA-trained methods (rmu's published recipe trains the MLPs themselves: no adapter).
LORA = "  lora:\n    r: 8\n    alpha: 16\n    dropout: 0.0\n"


def data_file(name: str) -> Path:
    """The path of a bundled demo data file (``forget.jsonl`` or ``retain.jsonl``)."""
    if name not in DATA_FILES:
        raise ValueError(f"no demo file {name!r}; the demo has {', '.join(DATA_FILES)}")
    return Path(str(resources.files("soup_plugin_unlearn") / "demo" / name))


def _learn_yaml(base: Path, out: Path) -> str:
    return f"""\
# Step 1: teach a tiny model every fact (forget and retain sets), so that it has something to forget.
base: {base}
task: sft
output: {out / "learned"}
data:
  train: facts.jsonl
  max_length: 64
training:
  lora:
    r: 0              # full fine-tuning: a tiny model memorises faster with every weight free
  learning_rate: 0.003
  scheduler: linear
  batch_size: 8
  max_steps: 150
  logging_steps: 25
"""


def _unlearn_yaml(method: str, out: Path) -> str:
    return f"""\
# Step 2: forget forget.jsonl while keeping retain.jsonl ({method}).
base: {out / "learned"}
task: unlearn
output: {out / f"unlearned-{method}"}
data:
  forget: forget.jsonl
  retain: retain.jsonl
  max_length: 64
training:
{METHOD_SETTINGS[method]}  learning_rate: 0.003
  batch_size: 4
  max_steps: {DEMO_STEPS}
  logging_steps: 10
{"" if method == "rmu" else LORA}"""


def write_demo(folder: str | Path, *, base: str | Path | None = None) -> dict[str, Path]:
    """Write the demo into ``folder``: ``forget.jsonl``, ``retain.jsonl``, ``facts.jsonl`` (both),
    ``learn.yaml`` (sft) and ``unlearn-{npo,simnpo,rmu}.yaml``. ``base`` is the model to teach; by default
    the tiny model (:data:`TINY`), built and cached under ``$SOUP_HOME/tiny``. Returns the written paths."""
    out = Path(folder).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if base is None:
        from soup_core.default_plugins.transformers import tiny_model_dir

        base = tiny_model_dir(**TINY)
    written: dict[str, Path] = {}
    texts = []
    for name in DATA_FILES:
        text = data_file(name).read_text(encoding="utf-8")
        texts.append(text if text.endswith("\n") else text + "\n")
        shutil.copyfile(data_file(name), out / name)
        written[name] = out / name
    written["facts.jsonl"] = atomic_write(out / "facts.jsonl", "".join(texts))
    written["learn.yaml"] = atomic_write(out / "learn.yaml", _learn_yaml(Path(base).resolve(), out))
    for method in METHOD_SETTINGS:
        name = f"unlearn-{method}.yaml"
        written[name] = atomic_write(out / name, _unlearn_yaml(method, out))
    return written
