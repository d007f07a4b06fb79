"""The bookkeeping of ``benchmarks/streaming.py`` (at the repository root): which parts a command line runs,
how a partial run merges into the recorded result without dropping the sections it did not rerun, and the
disk-over-resident ratios of (b). Nothing here trains a model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "streaming.py"
pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason="needs the repository's benchmarks/ folder")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("soup_bench_streaming", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parts_from_only_and_skip(bench):
    assert bench.select_parts("", "") == ["speed", "memory", "larger"]
    assert bench.select_parts("memory,larger", "") == ["memory", "larger"]
    assert bench.select_parts("larger,memory", "") == ["memory", "larger"]  # always in the script's order
    assert bench.select_parts("", "speed") == ["memory", "larger"]
    assert bench.select_parts("memory,larger", "larger") == ["memory"]


def test_an_unknown_part_is_refused_with_the_names_that_exist(bench):
    with pytest.raises(ValueError, match=r"--only: unknown part spede; the parts are speed, memory, larger"):
        bench.select_parts("spede", "")
    with pytest.raises(ValueError, match="--skip: unknown part mem"):
        bench.select_parts("", "mem")


def _old() -> dict:
    return {
        "benchmark": "streaming",
        "model": {"layers": 16},
        "machine": "old machine",
        "seconds": 457,
        "speed": {"ratio": 0.93},
        "memory": {"old": True},
        "larger_than_memory": {"old": True},
    }


def test_a_partial_run_replaces_only_its_sections(bench):
    new = {
        "benchmark": "streaming",
        "model": {"layers": 16, "parameters": 1},
        "machine": "new machine",
        "seconds": 60,
        "memory": {"new": True, "recorded": {"date": "d"}},
        "larger_than_memory": {"new": True, "recorded": {"date": "d"}},
    }
    merged = bench.merge_record(_old(), new, ["memory", "larger"])
    assert merged["speed"] == {"ratio": 0.93}  # kept, as recorded
    assert merged["memory"] == new["memory"] and merged["larger_than_memory"] == new["larger_than_memory"]
    # the run fields at the top stay the old run's, which recorded the kept section
    assert merged["machine"] == "old machine" and merged["seconds"] == 457
    assert merged["top_level_run_describes"] == ["speed"]
    assert merged["model"] == {"layers": 16, "parameters": 1}
    assert list(merged)[-3:] == ["speed", "memory", "larger_than_memory"]


def test_control_a_full_run_or_no_old_record_writes_the_new_result_as_is(bench):
    new = {"machine": "new", "speed": {"r": 1}, "memory": {"m": 1}, "larger_than_memory": {"l": 1}}
    assert bench.merge_record(_old(), new, ["speed", "memory", "larger"]) == new
    assert bench.merge_record(None, {"machine": "new", "memory": {"m": 1}}, ["memory"]) == {
        "machine": "new",
        "memory": {"m": 1},
    }


def test_disk_ratios(bench):
    def arm(anon: int, sampled: int, rss: int, ok: bool = True) -> dict:
        return {
            "ok": ok,
            "peak_anon_above_baseline": anon,
            "sampled_peak_anon_above_baseline": sampled,
            "peak_rss_above_baseline": rss,
        }

    arms = {
        "streamed_disk": arm(100, 90, 120),
        "resident_checkpointed": arm(400, 400, 1000),
        "resident": arm(800, 720, 1200),
    }
    assert bench.disk_ratios(arms) == {
        "disk_over_resident_checkpointed": {
            "anonymous": 0.25,
            "anonymous_sampled": 0.225,
            "resident_set": 0.12,
        },
        "disk_over_resident": {"anonymous": 0.125, "anonymous_sampled": 0.125, "resident_set": 0.1},
    }
    # an arm that failed gives no ratio rather than a wrong one
    arms["resident"] = arm(0, 0, 0, ok=False)
    assert list(bench.disk_ratios(arms)) == ["disk_over_resident_checkpointed"]
