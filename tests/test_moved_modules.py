"""Every module name ``soup_core`` had before its built-ins moved to ``soup_core/default_plugins`` still imports,
with one ``DeprecationWarning`` per name and process naming the new module, and every public name it had then
is still there, the same object as in the new module (docs/plugins.md, "Migration"). The table lists the old
modules and the public names each had (read from the source before the move: commit d8e4d55's parent, and
21533ee's for ``soup_core.distributed``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

#: old module -> the public names it had before the move
OLD_MODULES = {
    "soup_core.backends": "",
    "soup_core.backends.transformers": ("BackendError HONOURED_FIELDS PreparedRun TransformersBackend "
        "load_model_and_tokenizer merge_adapter"),
    "soup_core.backends.transformers.backend": ("HONOURED_FIELDS PreparedRun REPORTERS TransformersBackend "
        "build_training_args checkpoint_step"),
    "soup_core.backends.transformers.loading": ("BackendError apply_lora load_dtype load_model_and_tokenizer "
        "merge_adapter quantization_config quiet_progress resolve_dtype "
        "resolve_target_modules"),
    "soup_core.backends.transformers.plugin": ("SOUP_HOOK_API soup_load_model soup_register_backends "
        "soup_register_probes soup_register_support"),
    "soup_core.backends.transformers.progress": "ProgressDisplay",
    "soup_core.backends.transformers.trainer": ("EvalMetricsCallback IGNORE RowCollator RowOrderBatchSampler "
        "SoupSFTTrainer SoupTrainerMixin TrainerSetup datasets_for row_sums"),
    "soup_core.tiny": ("BUILDER_VERSION CHAT_TEMPLATE ROLE_TOKENS SPECIAL_TOKENS "
        "build_tiny_model build_tiny_tokenizer tiny_model_dir"),
    "soup_core.tasks": "SFTTask",
    "soup_core.tasks.sft": "EncodingError IGNORE SFTTask encode_example encode_rows has_generation_markers",
    "soup_core.tasks.plugin": "SOUP_HOOK_API soup_register_tasks",
    "soup_core.data.formats": "ALPACA_INPUT_HEADER ALPACA_RESPONSE_HEADER BUILTIN_FORMATS CHAT_ROLES alpaca_prompt",
    "soup_core.data.plugin": "SOUP_HOOK_API soup_register_data_formats",
    "soup_core.tracker.recorder": "TrackerRecorder",
    "soup_core.tracker.plugin": "SOUP_HOOK_API soup_register_commands soup_register_recorders",
    "soup_core.doctor": ("DependencyCheck DoctorReport Requirement build_report "
        "check_dependencies device_report fix_command installed_version "
        "normalise parse_requirement print_report soup_distributions"),
    "soup_core.quickstart": "CONFIG N_ROWS POISONED_ROW prepare synthetic_rows",
    "soup_core.distributed": "OVERRIDES_ENV RUN_ID_ENV env_overrides env_run_id launch",
    "soup_core.cli.builtin": "SOUP_HOOK_API soup_register_commands",
    "soup_core.cli.doctor_cmd": "DOCTOR_HELP doctor",
    "soup_core.cli.init_cmd": "CONFIG DEFAULT_BASE TEMPLATES init sample_rows",
    "soup_core.cli.merge_cmd": "merge",
    "soup_core.cli.plugins_cmd": "JSON_KEYS list_plugins plugins_app",
    "soup_core.cli.quickstart_cmd": "quickstart",
    "soup_core.cli.runs": "delete list_runs runs_app show",
    "soup_core.cli.train_cmd": "TRAIN_HELP run_train_command train",
}
#: old attributes of a package that stayed: name -> where it is now
OLD_NAMES = {
    "soup_core.data.BUILTIN_FORMATS": "soup_core.default_plugins.formats",
    "soup_core.data.alpaca_prompt": "soup_core.default_plugins.formats",
}

SCRIPT = """
import importlib, json, sys, warnings

old_modules, old_names = json.loads(sys.argv[1]), json.loads(sys.argv[2])
from soup_core.default_plugins.moved import MOVED

out = {"missing": [], "other": [], "warnings": [], "tiny": None}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from soup_core import tiny  # the import the issue names, as a user writes it
    out["tiny"] = tiny.__name__
    for old, names in old_modules.items():
        module = importlib.import_module(old)
        new = importlib.import_module(MOVED[old])
        for name in names.split():
            if not hasattr(module, name):
                out["missing"].append(old + "." + name)
            elif getattr(module, name) is not getattr(new, name):
                out["other"].append(old + "." + name)
        importlib.import_module(old)  # a second import: no second warning
    for dotted, new in old_names.items():
        package, name = dotted.rsplit(".", 1)
        if getattr(importlib.import_module(package), name) is not getattr(importlib.import_module(new), name):
            out["other"].append(dotted)
        getattr(importlib.import_module(package), name)
out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)
                   and "soup-core 1.0" in str(w.message)]
print(json.dumps(out))
"""


def test_every_old_module_name_still_imports_with_one_warning() -> None:
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(OLD_MODULES), json.dumps(OLD_NAMES)],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tiny"] == "soup_core.default_plugins.transformers.tiny"
    assert out["missing"] == [] and out["other"] == []
    warned = [message.split()[2] for message in out["warnings"]]
    assert sorted(warned) == sorted([*OLD_MODULES, *OLD_NAMES])  # each once, naming the old name
    for message in out["warnings"]:
        assert "import soup_core." in message  # and the new one


def test_the_migration_section_lists_every_old_module() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text(encoding="utf-8")
    migration = docs.split("## Migration", 1)[1].split("\n## ", 1)[0]
    for old in [*OLD_MODULES, *OLD_NAMES]:
        assert f"`{old}`" in migration, old
