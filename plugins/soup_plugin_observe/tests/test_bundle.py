"""Crash bundles: a run that crashes for real (a corrupt checkpoint on resume) writes
OUTPUT/soup-crash-RUN.tar.gz and says so last; no planted secret reaches the archive (the control: without
redaction each one is there); ``soup why`` on the bundle gives the verdict it gives on the run."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SECRETS = {"HF_TOKEN": "hf_plantedTOKENvalue123", "MY_API_KEY": "sk-plantedKEY456456",
           "DB_PASSWORD": "pw-planted789789", "SOME_SECRET_X": "planted-secret-000"}
PROXY = "http://alice:hunter2pass@proxy.example:8080"


@pytest.fixture(scope="module")
def crashed(helpers: Any, module_home: Path, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
            torch_one_thread: Any) -> dict[str, Any]:
    """A run that saved checkpoint-2, and a run resumed from it after its weights were corrupted, trained with
    secrets planted in the environment, in a URL, in the output path, and the home folder set above it all."""
    from soup_core.testing import TrainingFailed, train_in_process, write_jsonl

    work = tmp_path_factory.mktemp("observe-crash")
    rows = [{"messages": [{"role": "user", "content": f"question {i}?"},
                          {"role": "assistant", "content": f"answer {i}."}]} for i in range(16)]
    data = write_jsonl(work / "train.jsonl", rows)
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("SOUP_HOME", str(module_home))
        mp.setenv("HOME", str(work))
        for name, value in SECRETS.items():
            mp.setenv(name, value)
        mp.setenv("HTTPS_PROXY", PROXY)
        first = train_in_process(helpers.config(data, max_steps=2, save_steps=2), workdir=work, default_base=tiny_model)
        checkpoint = first.output_dir / "checkpoint-2"
        (checkpoint / "model.safetensors").write_bytes(b"not a safetensors file")
        resumed = helpers.config(data, max_steps=4, resume_from=str(checkpoint))
        resumed["experiment_name"] = SECRETS["HF_TOKEN"]  # the token's value in every path the run prints
        with pytest.raises(TrainingFailed) as failed:
            train_in_process(resumed, workdir=work, default_base=tiny_model)
        run_id = next(e.run_id for e in failed.value.events if type(e).__name__ == "RunStart")
        from soup_plugin_observe.bundle import Redactor, build
        from soup_plugin_observe.facts import from_tracker

        unredacted = build(from_tracker(run_id), redactor=Redactor(enabled=False))  # the control's archive
    finally:
        mp.undo()
    return {"run_id": run_id, "output": failed.value.output, "home": work, "unredacted": unredacted,
            "bundle": Path(from_tracker_output(module_home, run_id)) / f"soup-crash-{run_id}.tar.gz"}


def from_tracker_output(home: Path, run_id: str) -> str:
    import os

    from soup_core.tracker import Tracker

    with Tracker(home / "experiments.db") as tracker:
        record = tracker.get_run(run_id)
    assert record is not None and os.path.isdir(record.output_dir)
    return record.output_dir


def _texts(archive: bytes | Path) -> dict[str, bytes]:
    import io

    source = tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") if isinstance(archive, bytes) else \
        tarfile.open(archive, "r:gz")
    with source as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_a_crash_writes_its_bundle_and_says_so_last(crashed: dict[str, Any]) -> None:
    bundle = crashed["bundle"]
    assert bundle.is_file()
    last = [line for line in crashed["output"].splitlines() if line.strip()][-1]
    assert last.startswith(f"crash bundle: {bundle}")
    members = _texts(bundle)
    assert {"run.json", "config.yaml", "config.resolved.json", "doctor.json", "traceback.txt", "output.log",
            "environment.json", "rewind.tail.jsonl"} <= set(members)
    assert b"SafetensorError" in members["traceback.txt"] and b"loading the model" in members["output.log"]
    assert b"train.jsonl" in members["run.json"] and b'"sha256"' in members["run.json"]  # the data's fingerprint
    assert not any(name.startswith("data/") for name in members)  # no rows without --with-data


def test_no_planted_secret_reaches_the_bundle(crashed: dict[str, Any]) -> None:
    home = str(crashed["home"])
    planted = [*SECRETS.values(), "hunter2pass", "alice:", home]
    found = {p: [n for n, text in _texts(crashed["bundle"]).items() if p.encode() in text] for p in planted}
    assert all(not where for where in found.values()), found
    env = _texts(crashed["bundle"])["environment.json"].decode()
    assert '"HF_TOKEN": "[redacted]"' in env and "http://[redacted]@proxy.example:8080" in env
    # control: the same run's archive without redaction holds every one of them
    control = _texts(crashed["unredacted"])
    assert all(any(p.encode() in text for text in control.values()) for p in planted)


def test_why_on_the_bundle_gives_the_run_s_verdict(helpers: Any, crashed: dict[str, Any], module_home: Path) -> None:
    on_run = helpers.verdict(crashed["run_id"], module_home)
    on_bundle = helpers.verdict(str(crashed["bundle"]), module_home)
    assert on_run.kind == "crashed" and "resuming from a checkpoint" in on_run.headline
    assert on_run.key == "training.resume_from"
    assert any(e["source"] == "traceback (crash bundle)" and "SafetensorError" in e["text"] for e in on_run.evidence)
    same = ("kind", "status", "headline", "first_bad_step", "key", "run_id")
    assert {k: getattr(on_bundle, k) for k in same} == {k: getattr(on_run, k) for k in same}


def test_soup_bundle_makes_one_for_any_run(crashed: dict[str, Any], module_home: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from soup_core.cli.main import main

    monkeypatch.setenv("SOUP_HOME", str(module_home))
    target = tmp_path / "report.tar.gz"
    with pytest.raises(SystemExit) as done:
        main(["bundle", crashed["run_id"], "-o", str(target), "--with-data"])
    assert done.value.code in (0, None) and f"crash bundle: {target}" in capsys.readouterr().out
    members = _texts(target)
    assert members["data/train.jsonl"].startswith(b'{"messages"') and b"SafetensorError" in members["traceback.txt"]
    with pytest.raises(SystemExit) as missing:
        main(["bundle", "no_such_run"])
    assert missing.value.code == 1
