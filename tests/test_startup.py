"""Start-up: a run imports only what it uses, deep-probe verdicts are kept per installation, and asking for
a distribution that is not installed costs no ``importlib.metadata`` scan."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import types
from pathlib import Path

import pytest

from soup_core import Probe, Task, distributions, hookimpl
from soup_core.testing import isolated_plugins, write_jsonl, write_yaml

pytest_plugins = ["soup_core.testing"]

HEAVY = ("bitsandbytes", "peft", "trl", "datasets", "torch", "scipy")

# runs soup train in this fresh interpreter and prints which of HEAVY it imported
_TRAIN_AND_REPORT = f"""
import json, sys
from soup_core.default_plugins.commands.train_cmd import run_train_command
from pathlib import Path
code = run_train_command(Path(sys.argv[1]), overrides={{}}, dry_run=sys.argv[2] == "dry")
print("IMPORTED " + json.dumps({{"code": code, "modules": [m for m in {HEAVY!r} if sys.modules.get(m)]}}))
"""


def _train_and_report(config: Path, *, dry: bool) -> dict:
    import subprocess

    out = subprocess.run([sys.executable, "-c", _TRAIN_AND_REPORT, str(config), "dry" if dry else "train"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    line = [x for x in out.stdout.splitlines() if x.startswith("IMPORTED ")]
    assert line, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(line[-1].removeprefix("IMPORTED "))


def _config(tmp_path: Path, tiny_model: Path, name: str, **training: object) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(8)]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    return write_yaml(tmp_path / f"{name}.yaml", {
        "base": str(tiny_model), "data": {"train": "rows.jsonl"}, "output": f"out-{name}",
        "training": {"max_steps": 1, "batch_size": 2, **training}})


def test_a_run_without_quantisation_never_imports_bitsandbytes(tmp_path, tiny_model, soup_home) -> None:
    plain = _train_and_report(_config(tmp_path, tiny_model, "plain"), dry=False)
    assert plain["code"] == 0 and "peft" in plain["modules"] and "bitsandbytes" not in plain["modules"]
    assert "scipy" not in plain["modules"]  # (control: test_scipy_is_imported_by_transformers_unless_blocked)
    # control: the same run on a 4-bit base uses bitsandbytes, so imports it
    quantised = _train_and_report(_config(tmp_path, tiny_model, "nf4", quantization="4bit",
                                          bnb_4bit_use_double_quant=False), dry=False)
    assert quantised["code"] == 0 and "bitsandbytes" in quantised["modules"]


def test_a_dry_run_with_the_verdicts_kept_imports_neither_torch_nor_a_trainer_library(tmp_path, tiny_model,
                                                                                      soup_home) -> None:
    config = _config(tmp_path, tiny_model, "dry")
    # control: a fresh SOUP_HOME runs the deep probe (importing trl) and loads the base's config (torch)
    first = _train_and_report(config, dry=True)
    assert first["code"] == 0 and {"trl", "peft", "torch"} <= set(first["modules"])
    assert "bitsandbytes" not in first["modules"]
    second = _train_and_report(config, dry=True)
    assert second == {"code": 0, "modules": []}
    assert (soup_home / "cache" / "probes.json").is_file() and (soup_home / "cache" / "bases.json").is_file()


# ------------------------------------------------------------------------------------ the base verdict


def _copy_model(tiny_model: Path, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(tiny_model, to))


def test_a_kept_base_verdict_loads_the_tokenizer_auto_tokenizer_would(tmp_path, tiny_model, soup_home,
                                                                      monkeypatch) -> None:
    from transformers import AutoTokenizer

    from soup_core.default_plugins.prepared import tokenizer_fingerprint
    from soup_core.default_plugins.transformers import checks

    base = str(_copy_model(tiny_model, tmp_path / "m"))
    auto = AutoTokenizer.from_pretrained(base)
    chat = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    called: list[str] = []
    real = AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **k: called.append(a[0]) or real(cls, *a, **k)))
    checks.load_tokenizer(base)
    assert called == [base]  # control: nothing kept yet, so AutoTokenizer chooses
    assert checks.base_problem(base) is None and len(called) == 2
    light = checks.load_tokenizer(base)
    assert len(called) == 2  # the class AutoTokenizer chose is loaded directly
    assert type(light) is type(auto) and tokenizer_fingerprint(light) == tokenizer_fingerprint(auto)
    assert light.apply_chat_template(chat, tokenize=True) == auto.apply_chat_template(chat, tokenize=True)
    assert light("a b c")["input_ids"] == auto("a b c")["input_ids"]


def test_a_base_verdict_is_asked_again_when_its_files_or_the_installation_change(tmp_path, tiny_model,
                                                                                 soup_home, monkeypatch) -> None:
    from transformers import AutoConfig

    from soup_core.default_plugins.transformers import checks

    folder = _copy_model(tiny_model, tmp_path / "m")
    assert checks.base_problem(str(folder)) is None
    loads: list[str] = []
    real = AutoConfig.from_pretrained.__func__
    monkeypatch.setattr(AutoConfig, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(a[0]) or real(cls, *a, **k)))
    assert checks.base_problem(str(folder)) is None and loads == []  # kept: nothing loaded
    (folder / "model.safetensors").write_bytes(b"not read by the check")
    assert checks.base_problem(str(folder)) is None and loads == []  # the weights do not decide it
    # another installation: checked again
    real_installed = distributions.installed()
    changed = {**real_installed,
               "transformers": distributions.Installed("transformers", "0.0.1", "/elsewhere/t-0.0.1.dist-info")}
    monkeypatch.setattr(distributions, "installed", lambda path=None: changed)
    assert checks.base_problem(str(folder)) is None and loads and set(loads) == {str(folder)}
    monkeypatch.setattr(distributions, "installed", lambda path=None: real_installed)
    # a tokenizer file edited so that it no longer loads: checked again, and refused
    (folder / "tokenizer.json").write_text("{not json")
    seen = len(loads)
    problem = checks.base_problem(str(folder))
    assert problem and "the tokenizer in" in problem and "does not load" in problem and len(loads) > seen
    seen = len(loads)
    assert checks.base_problem(str(folder)) and len(loads) > seen  # a failure is never kept


def test_a_base_with_remote_code_is_never_kept(tmp_path, tiny_model, soup_home) -> None:
    import json as _json

    from soup_core.default_plugins.transformers import checks

    folder = _copy_model(tiny_model, tmp_path / "m")
    config = _json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(_json.dumps({**config, "auto_map": {}}))
    assert checks.base_problem(str(folder)) is None
    assert not (soup_home / "cache" / "bases.json").exists()
    (folder / "config.json").write_text(_json.dumps(config))  # control: without auto_map it is kept
    assert checks.base_problem(str(folder)) is None
    assert (soup_home / "cache" / "bases.json").is_file()


_BLOCK_THEN_USE = """
import sys
from soup_core.default_plugins.transformers.imports import without
with without("bitsandbytes") as blocked:
    import peft
    from peft.import_utils import is_bnb_available
    assert blocked == ("bitsandbytes",) and sys.modules["bitsandbytes"] is None and is_bnb_available() is False
    try:
        import bitsandbytes
        raise SystemExit("bitsandbytes imported inside the block")
    except ImportError:
        pass
assert is_bnb_available() is True  # the cached "not installed" was forgotten
from peft.tuners.lora.bnb import Linear4bit  # peft's layers for it are defined after all
print("OK", "bitsandbytes" in sys.modules)
"""


def test_a_quantised_run_after_a_blocked_one_in_one_process_finds_bitsandbytes() -> None:
    import subprocess

    out = subprocess.run([sys.executable, "-c", _BLOCK_THEN_USE], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["OK", "True"], out.stderr[-3000:]


_SCIPY_BLOCKED_OR_NOT = """
import sys
from soup_core.default_plugins.transformers.imports import without
if sys.argv[1] == "block":
    import transformers.utils.import_utils as iu
    assert iu.is_scipy_available() is True  # answered before the block: the block must make it forget
    with without("scipy"):
        import transformers.modeling_utils
        inside = sys.modules.get("scipy") is not None
    after = iu.is_scipy_available()
else:
    import transformers.modeling_utils
    inside = after = sys.modules.get("scipy") is not None
print("SCIPY", inside, after)
"""


@pytest.mark.parametrize(("how", "seen"), [("block", ["False", "True"]), ("plain", ["True", "True"])])
def test_scipy_is_imported_by_transformers_unless_blocked(how, seen) -> None:
    import subprocess

    out = subprocess.run([sys.executable, "-c", _SCIPY_BLOCKED_OR_NOT, how], capture_output=True, text=True,
                         timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("SCIPY ")]
    assert line and line[0].split()[1:] == seen, out.stderr[-3000:]


def test_few_collections_collects_the_oldest_generation_rarely_then_as_before() -> None:
    import gc

    from soup_core.default_plugins.transformers.imports import few_collections

    def full_collections() -> int:
        seen: list[int] = []

        def count(phase: str, info: dict) -> None:
            if phase == "start" and info["generation"] == 2:
                seen.append(1)

        gc.callbacks.append(count)
        try:
            keep = [[i] for i in range(300_000)]  # long-lived containers, as imports make
        finally:
            gc.callbacks.remove(count)
        del keep
        return len(seen)

    before = gc.get_threshold()
    with few_collections():
        assert gc.get_threshold()[0] >= 20_000
        rare = full_collections()
    assert gc.get_threshold() == before
    assert rare == 0 and full_collections() > 0  # control: at the thresholds restored, some full collections


def test_known_packages_answers_packages_distributions_once_per_installation(tmp_path, soup_home,
                                                                             monkeypatch) -> None:
    import importlib.metadata as metadata

    from soup_core.default_plugins.transformers.imports import known_packages

    truth = metadata.packages_distributions()
    calls: list[int] = []
    real = metadata.packages_distributions
    monkeypatch.setattr(metadata, "packages_distributions", lambda: calls.append(1) or real())
    spy = metadata.packages_distributions
    for _ in range(2):
        with known_packages():
            assert metadata.packages_distributions() == truth
        assert metadata.packages_distributions is spy  # given back after the block
    assert len(calls) == 1 and (soup_home / "cache" / "packages.json").is_file()
    # control: a folder of sys.path changed (an install would): asked again
    extra = tmp_path / "site"
    extra.mkdir()
    monkeypatch.syspath_prepend(str(extra))
    with known_packages():
        assert metadata.packages_distributions() == truth
    assert len(calls) == 2


# ------------------------------------------------------------------------------------ the probe cache


class _EchoTask(Task):
    name = "echo"
    formats = ("text",)


def _plugin_with_probe(check) -> types.SimpleNamespace:
    ns = types.SimpleNamespace(SOUP_HOOK_API=(1, 1))
    ns.soup_register_tasks = hookimpl(lambda: [_EchoTask])
    ns.soup_register_probes = hookimpl(lambda: [Probe("deep seam", check, deep=True, scope="task:echo")])
    return ns


def _probe_module(tmp_path: Path, verdict: str) -> types.ModuleType:
    """A probe in a file of its own (its verdict from ``verdict``), counting its calls in ``CALLS``."""
    path = tmp_path / "probe_mod.py"
    path.write_text(textwrap.dedent(f"""
        from soup_core import ProbeResult
        CALLS = []
        def check():
            CALLS.append(1)
            return {verdict}
    """))
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"probe_mod_{len(verdict)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_passed_deep_probe_is_kept_per_installation(tmp_path, soup_home, monkeypatch) -> None:
    module = _probe_module(tmp_path, 'ProbeResult(True, detail="seam ok")')
    plugins = isolated_plugins(("deepy", _plugin_with_probe(module.check)))
    for _ in range(3):
        assert plugins.requirements_for(backend="transformers", task="echo") == []
    assert len(module.CALLS) == 1
    # another version of any installed distribution is another installation: asked again
    real = distributions.installed()
    changed = {**real, "trl": distributions.Installed("trl", "0.0.1", "/elsewhere/trl-0.0.1.dist-info")}
    monkeypatch.setattr(distributions, "installed", lambda path=None: changed)
    assert plugins.requirements_for(backend="transformers", task="echo") == []
    assert len(module.CALLS) == 2
    monkeypatch.setattr(distributions, "installed", lambda path=None: real)
    # the probe's own source edited: asked again
    source = Path(module.__file__)
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    assert plugins.requirements_for(backend="transformers", task="echo") == []
    assert len(module.CALLS) == 3
    # soup plugins list --check always asks
    plugins.deep_check()
    assert len(module.CALLS) == 4


def test_a_failed_deep_probe_is_asked_every_time(tmp_path, soup_home) -> None:
    module = _probe_module(tmp_path, 'ProbeResult(False, "no seam", "pip install -U trl")')
    plugins = isolated_plugins(("deepy", _plugin_with_probe(module.check)))
    for _ in range(2):
        assert "no seam" in plugins.requirements_for(backend="transformers", task="echo")[0]
    assert len(module.CALLS) == 2


def test_an_unwritable_probe_cache_costs_only_time(tmp_path, monkeypatch) -> None:
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    monkeypatch.setenv("SOUP_HOME", str(home))
    module = _probe_module(tmp_path, "ProbeResult(True)")
    plugins = isolated_plugins(("deepy", _plugin_with_probe(module.check)))
    assert plugins.requirements_for(backend="transformers", task="echo") == []
    assert plugins.requirements_for(backend="transformers", task="echo") == []
    assert len(module.CALLS) == 2


# ------------------------------------------------------------------------------------ version_of


def test_a_distribution_that_is_not_installed_costs_no_metadata_scan(tmp_path, monkeypatch) -> None:
    calls: list[str] = []
    real = distributions.distributions
    monkeypatch.setattr(distributions, "distributions",
                        lambda path=None, name=None: calls.append(name) or real(path, name))
    assert distributions.version_of("mlx-metal-not-here") is None
    assert calls == []
    # control: an .egg-info distribution is still found, through importlib.metadata
    egg = tmp_path / "eggy_thing.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: eggy-thing\nVersion: 3.1\n")
    assert distributions.version_of("eggy-thing", path=[str(tmp_path)]) == "3.1"
    assert calls == ["eggy-thing"]
    assert distributions.version_of("pydantic") is not None


def test_requires_dist_is_read_as_importlib_metadata_reads_it(tmp_path) -> None:
    for dist in distributions.installed().values():  # every installed distribution, scipy's folded licence too
        assert distributions.requires(dist) == list(dist.metadata().requires or ()), dist.name
    folder = tmp_path / "made_up-1.0.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: made-up\nVersion: 1.0\nLicense: first line\n   \n  after a blank fold\n"
        "Requires-Dist: soup-core<0.2,>=0.1\nRequires-Dist: Soup_Core>=9; extra == 'x'\n"
        "Requires-Dist: other[extra]>=1; python_version >= '3'\n\nRequires-Dist: in-the-body\n")
    made = distributions.Installed("made-up", "1.0", str(folder))
    assert distributions.requires(made) == list(made.metadata().requires)
    assert len(distributions.requires(made)) == 3 and distributions.declared_range(made, "soup-core") == "<0.2,>=0.1"
    assert distributions.declared_range(made, "other") == ">=1" and distributions.declared_range(made, "nope") == ""


# ------------------------------------------------------------------------------------ leaving the process

_SOUP_WITH = """
import atexit, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
if "thread" in sys.argv[1:2]:
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished", flush=True))).start()
sys.argv = ["soup", *sys.argv[2:]]
from soup_core.cli.main import main
main()
print("main returned", flush=True)
"""


@pytest.mark.parametrize(("args", "code"), [(["--version"], 0), (["train", "-c", "missing.yaml"], 1),
                                            (["no-such-command"], 2)])
def test_the_soup_command_exits_with_its_code_after_the_atexit_handlers(tmp_path, args, code) -> None:
    import subprocess

    out = subprocess.run([sys.executable, "-c", _SOUP_WITH, "-", *args], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == code, out.stderr
    assert out.stdout.rstrip().endswith("atexit ran") and "main returned" not in out.stdout
    # control: a live non-daemon thread gets the normal exit, which waits for it
    waited = subprocess.run([sys.executable, "-c", _SOUP_WITH, "thread", *args], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert waited.returncode == code
    assert "thread finished" in waited.stdout and waited.stdout.rstrip().endswith("atexit ran")


# a controller that imports scipy and bitsandbytes at run start, in a fresh interpreter (nothing imported them)
_SCIPY_IN_A_RUN = """
import sys
from soup_core import Controller, hookimpl
from soup_core.testing import train_in_process

seen = []

class UsesScipy(Controller):
    name = "uses-scipy"

    def on_run_start(self, event):
        import bitsandbytes
        import scipy.optimize
        seen.extend([scipy.optimize.__name__, bitsandbytes.__name__])
        return ()

class Plugin:
    SOUP_HOOK_API = (1, 1)

    @hookimpl
    def soup_register_controllers(self):
        return [UsesScipy]

result = train_in_process(sys.argv[1], workdir=sys.argv[2], plugins=[("uses-scipy", Plugin())])
print("RUN", result.status, seen)
"""


def test_a_plugin_can_import_scipy_and_bitsandbytes_during_a_run(tmp_path, tiny_model, soup_home) -> None:
    import subprocess

    config = _config(tmp_path, tiny_model, "scipy")
    out = subprocess.run([sys.executable, "-c", _SCIPY_IN_A_RUN, str(config), str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    # control: test_scipy_is_imported_by_transformers_unless_blocked shows the block makes it unimportable
    assert "RUN completed ['scipy.optimize', 'bitsandbytes']" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
