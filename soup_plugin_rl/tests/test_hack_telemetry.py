"""``mitigation_log.jsonl`` survives its folder vanishing mid-run and never raises into training."""

from __future__ import annotations

import json
import shutil

from soup_plugin_rl.hack.telemetry import LOG_NAME, MitigationLog


def test_lines_are_strict_json_one_per_record(tmp_path):
    log = MitigationLog(tmp_path / LOG_NAME, report=lambda m: None)
    assert log.write({"step": 1, "vote": float("nan"), "raw": {"info_rm": float("inf")}, "beta": 0.1})
    assert log.write({"step": 2, "vote": 0.5, "signals": (0.25, None)})
    lines = (tmp_path / LOG_NAME).read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "vote": None, "raw": {"info_rm": None}, "beta": 0.1},
        {"step": 2, "vote": 0.5, "signals": [0.25, None]},
    ]
    assert "NaN" not in lines[0] and log.read()[1]["step"] == 2


def test_the_folder_vanishing_mid_run_is_recreated_with_one_warning(tmp_path):
    out = tmp_path / "run" / "out"
    out.mkdir(parents=True)
    warnings: list[str] = []
    log = MitigationLog(out / LOG_NAME, report=warnings.append)
    assert log.write({"step": 1})
    shutil.rmtree(tmp_path / "run")  # e.g. a shared temp root cleaned by another process
    assert log.write({"step": 2})
    assert [r["step"] for r in log.read()] == [2] and log.recreated == 1
    assert len(warnings) == 1 and "vanished" in warnings[0] and str(out) in warnings[0]
    shutil.rmtree(out)  # again: recreated again, no second warning
    assert log.write({"step": 3})
    assert [r["step"] for r in log.read()] == [3] and log.recreated == 2 and len(warnings) == 1
    assert log.dropped == 0


def test_an_unwritable_log_never_raises_and_warns_once(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the output folder should be", encoding="utf-8")
    warnings: list[str] = []
    log = MitigationLog(blocker / LOG_NAME, report=warnings.append)
    assert log.write({"step": 1}) is False
    assert log.write({"step": 2}) is False
    assert log.dropped == 2 and len(warnings) == 1 and "could not write" in warnings[0]
    # a value json cannot encode is reported the same way, not raised
    ok = MitigationLog(tmp_path / LOG_NAME, report=warnings.append)
    assert ok.write({"bad": object()}) is True  # unknown objects are written as their text
    assert ok.write({1j: 2}) is True and ok.read()[1] == {"1j": 2}


def test_a_failing_report_does_not_raise_either(tmp_path):
    def broken(message: str) -> None:
        raise OSError("stderr is closed")

    (tmp_path / "out").mkdir()
    log = MitigationLog(tmp_path / "out" / LOG_NAME, report=broken)
    shutil.rmtree(tmp_path / "out")
    assert log.write({"step": 1}) is True  # recreated and written; the failed warning is swallowed
    assert log.read() == [{"step": 1}]
    (tmp_path / "blocker").write_text("x", encoding="utf-8")
    blocked = MitigationLog(tmp_path / "blocker" / LOG_NAME, report=broken)
    assert blocked.write({"step": 1}) is False and blocked.dropped == 1
