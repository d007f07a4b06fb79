"""The plugin registers its three commands, imports nothing heavy to do so, and uses only soup-core's public API;
Ctrl-C in a command exits 130."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from eval_kit import Runs, invoke

import soup_plugin_eval.plugin as plugin

SRC = Path(__file__).resolve().parents[1] / "src" / "soup_plugin_eval"


def test_registers_three_commands() -> None:
    from soup_core.testing import isolated_plugins

    plugins = isolated_plugins(("eval", plugin))
    assert plugins.plugins["eval"].status == "ok"
    assert {"generate", "chat", "eval"} <= set(plugins.commands)


def test_registration_imports_nothing_heavy() -> None:
    code = ("import sys, soup_plugin_eval.plugin as p; p.soup_register_commands(); "
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'lm_eval', 'mlx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_api_only() -> None:
    from soup_core.testing import private_core_imports

    found = {path.name: private_core_imports(path.read_text(encoding="utf-8")) for path in SRC.glob("*.py")}
    assert {name: uses for name, uses in found.items() if uses} == {}
    assert private_core_imports("from soup_core.ui import console\n")  # the control: a private import is named


def test_ctrl_c_exits_130(in_home: Runs, monkeypatch) -> None:
    import soup_plugin_eval.model as model
    from soup_plugin_eval.chat import chat

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "generate", interrupted)
    result = invoke(chat, [str(in_home.lora.output_dir)], input="what is 1 plus 1?\n")
    assert result.exit_code == 130 and "Traceback" not in result.output, result.output
