"""``soup train --cloud``: the GPU it picks (against hand arithmetic), the SkyPilot task it writes (validated by
SkyPilot's own parser, in SkyPilot's own environment), what never reaches the task (a planted secret, with a
control), the task's ``setup`` and ``run`` executed here as two machines on the tiny model, and
``--cloud-submit`` (without SkyPilot; with a stand-in for its API, recorded in the tracker)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from soup_core.testing import run_soup, write_jsonl, write_yaml

from soup_plugin_cloud import accelerators as acc

REPO = Path(__file__).resolve().parents[3]
ROWS = [{"messages": [{"role": "user", "content": f"question {i} about {i * 7}?"},
                      {"role": "assistant", "content": f"answer {i} is {i * 3}."}]} for i in range(12)]
#: Llama-2-7B's shape (its real parameter count is 6,738,415,616), SmolLM2-135M's, Llama-3-70B's
LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32000, "tie_word_embeddings": False}
SMOL_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}


def run_config(**training: object) -> SimpleNamespace:
    lora = {"r": training.pop("r", 8)}
    t = {"dtype": "auto", "quantization": "none", "batch_size": 4, "gradient_checkpointing": False,
         "sharding": "none", **training}
    max_length = t.pop("max_length", 1024)
    return SimpleNamespace(training=SimpleNamespace(lora=SimpleNamespace(**lora), **t),
                           data=SimpleNamespace(max_length=max_length))


# ------------------------------------------------------------------------------- the estimate, by hand


def test_the_estimate_is_the_hand_arithmetic_for_three_model_sizes() -> None:
    # 7B, LoRA r 16, bfloat16, batch 4 x 1024 tokens, gradient checkpointing
    #   P = 32000*4096*2 + 32*(4*4096*4096 + 3*4096*11008 + 2*4096) + 4096 = 6,738,415,616
    #   A = 16 * 32 * (4*(4096+4096) + 3*(4096+11008)) = 39,976,960
    shape = acc.Shape.from_config(LLAMA_7B)
    assert shape.params() == 6_738_415_616 and shape.adapter_params(16) == 39_976_960
    need = acc.estimate(shape, run_config(r=16, dtype="bfloat16", gradient_checkpointing=True))
    assert need.parts == {"weights": 6_738_415_616 * 2, "training state": 39_976_960 * 16,
                          "activations": 4096 * 4096 * 2 * (17 + 32), "logits": 4096 * 32000 * 8,
                          "overhead": 1.5e9}
    assert need.total == 18_309_205_760  # 13.48 + 0.64 + 1.64 + 1.05 + 1.5 GB
    assert acc.choose(shape, run_config(r=16, dtype="bfloat16", gradient_checkpointing=True))[:2] == ("L4", 1)

    # 135M (tied, 3 key-value heads of 64), full fine-tuning in float32, batch 8 x 2048, no checkpointing
    #   P = 49152*576 + 30*(576*576 + 2*576*192 + 576*576 + 3*576*1536 + 2*576) + 576 = 134,515,008
    shape = acc.Shape.from_config(SMOL_135M)
    assert shape.params() == 134_515_008
    cfg = run_config(r=0, dtype="float32", batch_size=8, max_length=2048)
    need = acc.estimate(shape, cfg)
    assert need.parts == {"weights": 134_515_008 * 4, "training state": 3 * 134_515_008 * 4,
                          "activations": 16384 * 576 * 4 * 17 * 30, "logits": 16384 * 49152 * 8,
                          "overhead": 1.5e9}
    assert need.total == 29_346_546_432  # over L4's 21.6 usable GB, under A100's 36
    assert acc.choose(shape, cfg)[:2] == ("A100", 1)

    # 70B (8 key-value heads of 128), NF4, LoRA r 16, batch 1 x 4096, checkpointing
    #   P = 128256*8192*2 + 80*(8192*8192*2 + 2*8192*1024 + 3*8192*28672 + 2*8192) + 8192 = 70,553,706,496
    #   A = 16 * 80 * (2*(8192+8192) + 2*(8192+1024) + 3*(8192+28672)) = 207,093,760
    shape = acc.Shape.from_config(LLAMA_70B)
    assert shape.params() == 70_553_706_496 and shape.adapter_params(16) == 207_093_760
    cfg = run_config(r=16, quantization="4bit", batch_size=1, max_length=4096, gradient_checkpointing=True)
    need = acc.estimate(shape, cfg)
    assert need.total == 70_553_706_496 * 0.5 + 207_093_760 * 16 + 4096 * 8192 * 2 * 97 + 4096 * 128256 * 8 + 1.5e9
    assert round(need.total) == 50_802_605_824  # over A100's 36, under A100-80GB's 72
    assert acc.choose(shape, cfg)[:2] == ("A100-80GB", 1)
    # in bfloat16 (batch 4 x 1024) the 70B fits no single device; fsdp splits weights and state over 8 A100s:
    #   (70,553,706,496 * 2 + 207,093,760 * 16) / 8 + 4096*8192*2*97 + 4096*128256*8 + 1.5e9 = 30.26 GB < 36
    #   (over 4 of them: 48.3 GB; the T4s and L4s fall short even at 8)
    cfg = run_config(r=16, dtype="bfloat16", gradient_checkpointing=True)
    assert acc.choose(shape, cfg) is None
    cfg.training.sharding = "fsdp"
    name, count, need = acc.choose(shape, cfg)
    assert (name, count, need.total) == ("A100", 8, 30_264_866_560)


def model_folder(where: Path, shape: dict) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(shape))
    return where


def cloud_config(folder: Path, base: str, **training: object) -> Path:
    write_jsonl(folder / "train.jsonl", ROWS)
    return write_yaml(folder / "soup.yaml", {
        "base": base, "output": "out", "data": {"train": "train.jsonl", "max_length": 32},
        "training": {"max_steps": 3, "batch_size": 2, "logging_steps": 1, "learning_rate": 0.005, **training}})


def plan(cfg: Path, *flags: str, env: dict | None = None) -> dict:
    done = run_soup(["train", "-c", str(cfg), "--cloud", *flags], env=env)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load((cfg.parent / "soup-sky.yaml").read_text())


def test_the_command_picks_the_gpu_and_gpus_overrides_it(tmp_path: Path) -> None:
    model_folder(tmp_path / "llama7b", LLAMA_7B)
    cfg = write_yaml(tmp_path / "soup.yaml", {"base": "./llama7b", "data": {"train": "train.jsonl", "max_length": 1024},
                                              "training": {"batch_size": 4, "gradient_checkpointing": True,
                                                           "dtype": "bfloat16", "lora": {"r": 16}}})
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    task = plan(cfg)
    assert task["resources"]["accelerators"] == "L4:1" and task["num_nodes"] == 1
    assert plan(cfg, "--gpus", "A100:8", "--nnodes", "2")["resources"]["accelerators"] == "A100:8"
    # a base with no config.json here cannot be sized: --gpus is asked for, nothing is written
    (tmp_path / "soup-sky.yaml").unlink()
    cfg.write_text(cfg.read_text().replace("./llama7b", "some-org/not-cached-here"))
    done = run_soup(["train", "-c", str(cfg), "--cloud"], env={"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1 and "--gpus NAME:N" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "soup-sky.yaml").exists()


def test_setup_installs_the_soup_distributions_of_this_machine_and_the_plugins_the_config_uses(tmp_path: Path) -> None:
    import importlib.metadata

    core = importlib.metadata.version("soup-core")
    cfg = cloud_config(tmp_path, "some-org/model")
    assert plan(cfg, "--gpus", "T4")["setup"].count("soup-") == 1  # sft on transformers: the core alone
    assert f"'soup-core[train]=={core}'" in plan(cfg, "--gpus", "T4")["setup"]
    cfg.write_text(cfg.read_text() + "task: weighted_sft\n")  # the example plugin's task
    setup = plan(cfg, "--gpus", "T4")["setup"]
    example = importlib.metadata.version("soup-plugin-example")
    assert f"install --quiet 'soup-core[train]=={core}' soup-plugin-example=={example}\n" in setup


@pytest.mark.parametrize(("flags", "says"), [
    (["--gpus", "A100:8"], "go with --cloud"),
    (["--cloud", "--spot", "--gpus", "T4"], "--spot needs --cloud-store"),
    (["--cloud", "--nproc", "2"], "drop --nproc"),
    (["--cloud", "--gpus", "A100:x"], "NAME or NAME:COUNT"),
    (["--cloud", "--cloud-store", "my-bucket"], "bucket URI"),
])
def test_flags_that_do_not_go_together_are_refused(tmp_path: Path, flags: list[str], says: str) -> None:
    cfg = cloud_config(tmp_path, "some-org/model")
    done = run_soup(["train", "-c", str(cfg), *flags])
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "soup-sky.yaml").exists()


def test_without_the_plugin_the_core_names_it(tmp_path: Path) -> None:
    cfg = cloud_config(tmp_path, "some-org/model")
    done = run_soup(["-p", "no:cloud", "train", "-c", str(cfg), "--cloud", "--gpus", "T4"])
    assert done.returncode == 1 and "pip install soup-plugin-cloud" in done.stderr


# ---------------------------------------------------------------------------- SkyPilot's own parser


def sky_python() -> str | None:
    """SkyPilot's own environment: ``SOUP_SKY_PYTHON``, or the ``.venv-sky`` that scripts/install makes."""
    given = os.environ.get("SOUP_SKY_PYTHON") or str(REPO / ".venv-sky" / "bin" / "python")
    return given if Path(given).is_file() else None


SKY_CHECK = """
import json, sys
import sky
out = []
for path in sys.argv[1:]:
    try:
        task = sky.Task.from_yaml(path)
    except Exception as exc:
        out.append({"error": type(exc).__name__ + ": " + str(exc)[:300]})
        continue
    [res] = list(task.resources)
    out.append({"nodes": task.num_nodes, "accelerators": res.accelerators, "spot": res.use_spot,
                "disk": res.disk_size, "mounts": sorted(task.file_mounts or {}),
                "stores": sorted(task.storage_mounts or {}), "envs": sorted(task.envs)})
print(json.dumps(out))
"""


def test_skypilot_parses_the_task_for_one_node_several_and_spot(tmp_path: Path, tiny_model: Path) -> None:
    python = sky_python()
    if python is None:
        if os.environ.get("SOUP_REQUIRE_SKY") == "1":  # scripts/test: CI must run it
            pytest.fail("no SkyPilot environment: scripts/install makes .venv-sky (or set SOUP_SKY_PYTHON)")
        pytest.skip("no SkyPilot environment (.venv-sky from scripts/install, or SOUP_SKY_PYTHON)")
    paths = []
    for name, flags in (("one", []), ("two", ["--nnodes", "2", "--gpus", "A100:8"]),
                        ("spot", ["--spot", "--cloud-store", "s3://my-bucket/soup", "--gpus", "L4:1"])):
        (tmp_path / name).mkdir()
        plan(cloud_config(tmp_path / name, str(tiny_model)), *flags)
        paths.append(str(tmp_path / name / "soup-sky.yaml"))
    broken = tmp_path / "broken.yaml"  # control: SkyPilot's parser refuses what its schema does not know
    broken.write_text(Path(paths[2]).read_text().replace("use_spot: true", "use_spot: maybe"))
    done = subprocess.run([python, "-c", SKY_CHECK, *paths, str(broken)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "SKYPILOT_DEBUG": "0", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    one, two, spot, bad = json.loads(done.stdout.splitlines()[-1])
    assert one["nodes"] == 1 and one["accelerators"] == {"T4": 1} and not one["spot"]
    assert two["nodes"] == 2 and two["accelerators"] == {"A100": 8}
    assert spot["spot"] and spot["accelerators"] == {"L4": 1} and spot["stores"] == ["/soup-store"]
    assert "~/soup-job/soup.yaml" in one["mounts"] and "SOUP_CONFIG_OVERRIDES" in one["envs"]
    assert "use_spot" in bad["error"]


# ------------------------------------------------------------------------------------------ secrets


def test_a_planted_secret_never_reaches_the_task(tmp_path: Path) -> None:
    secret_env, secret_file = "planted-env-7c1f9e", "planted-file-4b2d8a"
    model_folder(tmp_path / "llama7b", LLAMA_7B)
    cfg = cloud_config(tmp_path, "./llama7b")
    (tmp_path / ".env").write_text(f"AWS_SECRET_ACCESS_KEY={secret_file}\n")
    (tmp_path / "credentials.json").write_text(json.dumps({"token": secret_file}))
    env = {"AWS_SECRET_ACCESS_KEY": secret_env, "HF_TOKEN": secret_env, "WANDB_API_KEY": secret_env}
    task = plan(cfg, env=env)
    text = (tmp_path / "soup-sky.yaml").read_text()
    assert secret_env not in text and secret_file not in text
    assert not any(Path(src).name in (".env", "credentials.json") for src in task["file_mounts"].values())
    assert sorted(task["envs"]) == ["OMP_NUM_THREADS", "PYTHONUNBUFFERED", "SOUP_CONFIG_OVERRIDES", "SOUP_RDZV_PORT"]
    # control: a string the run does read (a data file's name) is in the task, so the search can find one
    shutil.copy(tmp_path / "train.jsonl", tmp_path / f"{secret_file}.jsonl")
    plan(cfg, "--data", str(tmp_path / f"{secret_file}.jsonl"), env=env)
    assert secret_file in (tmp_path / "soup-sky.yaml").read_text()


# ------------------------------------------------------------------------- two machines, here


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mount(task: dict, home: Path, bucket: Path) -> dict[str, str]:
    """What SkyPilot does before ``setup``: copy each file mount to the machine; the bucket is a folder here."""
    env = {}
    for remote, local in task["file_mounts"].items():
        if isinstance(local, dict):  # the store: the bucket mounted at /soup-store; here, a shared folder
            env["SOUP_CLOUD_STORE"] = str(bucket)
            continue
        target = Path(remote.replace("~", str(home), 1))
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if Path(local).is_dir() else shutil.copy)(local, target)
    return env


def start_machines(task: dict, root: Path, bucket: Path, port: int) -> list[tuple[subprocess.Popen, Path]]:
    """Each machine: its file mounts copied, ``setup`` run, then ``run`` started, with the variables SkyPilot
    sets (docs: environment variables) given by hand; each its own HOME and SOUP_HOME, the bucket shared."""
    started = []
    venv_bin = str(Path(sys.executable).parent)
    for rank in (1, 0):  # node 1 first: which machine holds global rank 0 is the rendezvous's choice
        home = root / f"node{rank}"
        shutil.rmtree(home / "soup-job", ignore_errors=True)  # a recovery gets fresh machines
        home.mkdir(exist_ok=True)
        env = {"PATH": venv_bin + os.pathsep + os.environ["PATH"], "HOME": str(home), "SOUP_HOME": str(home / ".soup"),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               **{k: str(v) for k, v in task["envs"].items()}, **mount(task, home, bucket),
               "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_GPUS_PER_NODE": "1",
               "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1", "SKYPILOT_TASK_ID": f"local-{port}",
               "SOUP_RDZV_PORT": str(port), "SOUP_CLOUD_SKIP_INSTALL": "1"}
        setup = subprocess.run(["bash", "-c", task["setup"]], env=env, cwd=home, capture_output=True, text=True)
        assert setup.returncode == 0 and "install skipped" in setup.stdout, setup.stderr
        started.append((subprocess.Popen(["bash", "-c", task["run"]], env=env, cwd=home, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True), home))
    return started


def finish(started: list[tuple[subprocess.Popen, Path]]) -> list[str]:
    outputs = [p.communicate(timeout=300) for p, _ in started]
    assert [p.returncode for p, _ in started] == [0, 0], [o[1][-2500:] for o in outputs]
    return [out + err for out, err in outputs]


def tracked(root: Path) -> list[tuple[str, list[float]]]:
    """Every run recorded on either machine: (status, losses)."""
    from soup_core import Tracker

    rows = []
    for rank in (0, 1):
        db = root / f"node{rank}" / ".soup" / "experiments.db"
        if db.exists():
            with Tracker(db) as tracker:
                rows += [(r.status, [m["loss"] for _, m in tracker.metrics(r.run_id) if "loss" in m])
                         for r in tracker.list_runs(None)]
    return rows


@pytest.mark.slow
def test_the_task_runs_on_two_local_machines_as_one_run(tmp_path: Path, tiny_model: Path) -> None:
    (tmp_path / "job").mkdir()
    cfg = cloud_config(tmp_path / "job", str(tiny_model))
    task = plan(cfg, "--nnodes", "2", "--gpus", "T4:1", "--cloud-store", "s3://my-bucket/run")
    bucket = tmp_path / "bucket"
    finish(start_machines(task, tmp_path, bucket, free_port()))
    [(status, losses)] = tracked(tmp_path)  # one run, recorded once, on the machine that held global rank 0
    assert status == "completed" and len(losses) == 3
    # the output went to the store: the adapter, its run's manifest, both ranks' rewind logs, no lock
    assert (bucket / "adapter_model.safetensors").is_file() and (bucket / ".soup_run.json").is_file()
    assert (bucket / "rewind.jsonl").is_file() and (bucket / "rewind.rank1.jsonl").is_file()
    assert not (bucket / ".soup.lock").exists()
    adapter = (bucket / "adapter_model.safetensors").read_bytes()
    # a recovery on fresh machines: the store comes back, the run is found finished, nothing trains again
    said = finish(start_machines(task, tmp_path, bucket, free_port()))
    assert all("nothing to resume" in out for out in said), said
    assert len(tracked(tmp_path)) == 1 and (bucket / "adapter_model.safetensors").read_bytes() == adapter


# ------------------------------------------------------------------------------------ --cloud-submit


def test_submit_without_skypilot_says_the_pip_line_and_writes_nothing(tmp_path: Path) -> None:
    cfg = cloud_config(tmp_path, "some-org/model")
    done = run_soup(["train", "-c", str(cfg), "--cloud-submit", "--gpus", "T4"])
    if "sky" in done.stderr and "not installed" not in done.stderr:
        pytest.skip("SkyPilot is installed beside Soup here")
    assert done.returncode == 1 and "pip install 'soup-core[cloud]'" in done.stderr
    assert done.stderr.count("error:") == 1 and not (tmp_path / "soup-sky.yaml").exists()


STAND_IN = '''"""A stand-in for SkyPilot's client API: records what it is asked, launches nothing."""
import json, os
CALLS = os.environ["SKY_CALLS"]
def _log(*call):
    with open(CALLS, "a") as f:
        f.write(json.dumps(call) + "\\n")
class Task:
    @staticmethod
    def from_yaml(path):
        _log("from_yaml", path)
        return path
def launch(task, cluster_name=None):
    _log("launch", task, cluster_name)
    return "request-1"
class jobs:
    @staticmethod
    def launch(task, name=None):
        _log("jobs.launch", task, name)
        return "request-2"
def stream_and_get(request):
    _log("stream_and_get", request)
'''


def test_submit_launches_through_the_api_and_records_the_run(tmp_path: Path) -> None:
    from soup_core import Tracker

    stand_in = tmp_path / "fake"
    (stand_in / "sky").mkdir(parents=True)
    (stand_in / "sky" / "__init__.py").write_text(STAND_IN)
    (tmp_path / "job").mkdir()
    cfg = cloud_config(tmp_path / "job", "some-org/model")
    calls = tmp_path / "calls.jsonl"
    done = run_soup(["train", "-c", str(cfg), "--cloud-submit", "--gpus", "H100:8", "--spot", "--cloud-store",
                     "gs://b/run", "--cloud-name", "my-run"], env={"SKY_CALLS": str(calls)}, extra_path=[stand_in])
    assert done.returncode == 0, done.stderr
    task_path = str(tmp_path / "job" / "soup-sky.yaml")
    assert [json.loads(line) for line in calls.read_text().splitlines()] == [
        ["from_yaml", task_path], ["jobs.launch", task_path, "my-run"], ["stream_and_get", "request-2"]]
    with Tracker() as tracker:
        [row] = tracker.list_runs(None)
    assert row.status == "submitted" and row.host == "sky:my-run" and row.pid is None
    assert row.summary["cloud_command"] == f"sky jobs launch -n my-run {task_path}" and row.output_dir == "gs://b/run"
    shown = run_soup(["runs", "show", row.run_id])
    assert shown.returncode == 0 and "submitted" in shown.stdout
    # a plan-only call records nothing
    assert plan(cfg, "--gpus", "T4") and len(Tracker().list_runs(None)) == 1


def test_the_plan_imports_no_torch_and_is_quick(tmp_path: Path) -> None:
    model_folder(tmp_path / "llama7b", LLAMA_7B)
    cfg = cloud_config(tmp_path, "./llama7b")
    probe = ("import sys\nfrom soup_core.cli.main import main\n"
             "try:\n    main(['train', '-c', sys.argv[1], '--cloud'])\nexcept SystemExit as e:\n"
             "    assert not e.code, e.code\n"
             "print('HEAVY=' + ','.join(sorted({'torch', 'transformers', 'trl', 'peft'} & set(sys.modules))))")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", probe, str(cfg)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    took = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "HEAVY=" and (tmp_path / "soup-sky.yaml").is_file()
    assert took < 3.0
