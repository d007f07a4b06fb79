"""The instrument behind the calibration: it reads a known allocation back, and it reads nothing when
nothing was allocated; and the allocator setting the CPU pre-flight relies on gives freed memory back."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from soup_plugin_streaming import memwatch

SRC = Path(memwatch.__file__).resolve().parents[1]
MiB = 2**20

pytestmark = pytest.mark.skipif(not memwatch.status(), reason="reads /proc (Linux)")


def test_a_window_reads_back_a_known_transient_allocation(torch_one_thread):
    window = memwatch.Window()
    window.start()
    block = torch_one_thread.ones(256 * MiB // 4)  # touched, so resident: 256 MiB
    del block
    result = window.stop()
    assert 250 * MiB <= result["peak_above_baseline"] <= 256 * MiB + 24 * MiB, result
    # both readings saw it: the sampler and the kernel's high-water mark
    assert result["sampled_peak_anon"] - result["baseline_anon"] >= 250 * MiB
    assert result["hwm_peak_anon"] - result["baseline_anon"] >= 250 * MiB
    assert result["end"]["RssAnon"] - result["baseline_anon"] < 24 * MiB  # and it was given back


def test_control_a_window_without_an_allocation_reads_little(torch_one_thread):
    window = memwatch.Window()
    window.start()
    torch_one_thread.ones(16).sum()
    result = window.stop()
    assert result["peak_above_baseline"] < 16 * MiB, result


_RETAIN = textwrap.dedent(
    """
    import ctypes, sys
    from soup_plugin_streaming import memwatch
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if sys.argv[1] == "tamed":
        assert memwatch.tame_allocator()
    base = memwatch.anon_now()
    big = libc.malloc(16 << 20)  # a large block freed: glibc raises its threshold to its size
    ctypes.memset(big, 1, 16 << 20)
    libc.free(big)
    blocks = [libc.malloc(1 << 20) for _ in range(100)]
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    peak = memwatch.anon_now() - base
    for b in blocks[:-1]:
        libc.free(b)
    print(peak >> 20, (memwatch.anon_now() - base) >> 20)
    """
)


def _retained(mode: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _RETAIN, mode],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    peak, after = (int(x) for x in out.stdout.split())
    return peak, after


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_the_tamed_allocator_gives_freed_blocks_back_and_the_default_does_not():
    peak, after = _retained("tamed")
    assert peak >= 99 and after <= 2  # 99 of the 100 MiB are back with the system
    peak, after = _retained("default")  # control: glibc's default keeps them in its heap
    assert peak >= 99 and after >= 95


def test_limits_are_read():
    limits = memwatch.read_limits()
    assert set(limits) == {"data", "as", "cgroup", "cgroup_usage"}
