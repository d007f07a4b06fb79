"""mlx's CPU matmuls on OpenBLAS (soup_plugin_mlx.blas): routed for real, the settings that turn it off or
point elsewhere, and what happens when it cannot be had. Each case runs in a fresh process: which BLAS mlx
binds is decided once per process, when mlx.core is imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shim is for mlx on Linux")
HAS_CC = bool(shutil.which("cc") or shutil.which("gcc"))
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler to build the shim")

# mlx's product of two float32 matrices against scipy-openblas32's own sgemm called directly on the same
# inputs, bit for bit, and within float32 rounding (the sanity both sides pass)
ROUTED = """
import ctypes, json, os
import numpy as np
from soup_plugin_mlx import blas
choice = blas.activate()
import mlx.core as mx
import scipy_openblas32
rng = np.random.default_rng(0)
m, k, n = 64, 300, 48
a = rng.standard_normal((m, k), dtype=np.float32)
b = rng.standard_normal((k, n), dtype=np.float32)
got = np.array(mx.array(a) @ mx.array(b))
lib = ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), scipy_openblas32.get_library(fullname=True)))
sgemm, P = lib.scipy_cblas_sgemm, ctypes.c_void_p
sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, P, ctypes.c_int, P, ctypes.c_int, ctypes.c_float, P,
                                       ctypes.c_int]
want = np.zeros((m, n), np.float32)
sgemm(101, 111, 111, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, n, 0.0, want.ctypes.data, n)  # row-major
print(json.dumps({"optimized": choice.optimized, "line": choice.line(),
                  "equal": bool(np.array_equal(got, want)),
                  "close": bool(np.allclose(got, want, rtol=1e-4, atol=1e-4))}))
"""

CHOICE = """
import json
from soup_plugin_mlx import blas
try:
    choice = blas.activate()
except blas.BlasSettingError as exc:
    print(json.dumps({"error": str(exc), "reason": exc.reason, "fix": exc.fix}))
else:
    print(json.dumps({"optimized": choice.optimized, "line": choice.line(), "name": choice.name,
                      "library": str(choice.library)}))
"""


def _python(code: str, home: Path, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("SOUP_MLX_BLAS", "CC")}
    environ.update(SOUP_HOME=str(home), OPENBLAS_NUM_THREADS="1", **env)
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_cc
def test_mlx_multiplies_with_openblas_bit_for_bit(tmp_path: Path) -> None:
    got = _python(ROUTED, tmp_path)
    assert got["optimized"] and got["line"].startswith("mlx CPU matmuls: OpenBLAS 0.3."), got
    assert got["equal"] and got["close"], got
    # control: with mlx's own reference BLAS the same product differs in its last bits, so `equal` can fail
    control = _python(ROUTED, tmp_path, SOUP_MLX_BLAS="off")
    assert not control["optimized"] and control["line"].endswith("(SOUP_MLX_BLAS=off)"), control
    assert control["close"] and not control["equal"], control


@needs_cc
def test_the_shim_is_built_once_and_rebuilt_when_damaged(tmp_path: Path) -> None:
    first = _python(CHOICE, tmp_path)
    shim = Path(first["library"])
    assert first["optimized"] and shim.is_file() and shim.is_relative_to(tmp_path / "cache" / "mlx-blas")
    built = shim.stat().st_mtime_ns
    assert _python(CHOICE, tmp_path)["library"] == str(shim) and shim.stat().st_mtime_ns == built  # reused
    shim.write_bytes(b"not a library")  # a damaged cache entry
    again = _python(CHOICE, tmp_path)
    assert again["optimized"] and shim.read_bytes()[:4] == b"\x7fELF", again


def test_without_a_compiler_mlx_keeps_its_own_blas_and_the_line_says_how_to_fix_it(tmp_path: Path) -> None:
    got = _python(CHOICE, tmp_path, CC="/bin/false")
    assert not got["optimized"], got
    assert "could not be built or loaded: false exited 1" in got["line"], got
    assert "apt install gcc" in got["line"], got
    assert not list((tmp_path / "cache" / "mlx-blas").rglob("*.so"))  # nothing half-written left behind


@needs_cc
def test_a_named_library_is_used_or_refused_with_the_reason(tmp_path: Path) -> None:
    shim = Path(_python(CHOICE, tmp_path)["library"])
    named = _python(CHOICE, tmp_path / "other", SOUP_MLX_BLAS=str(shim))
    assert named["optimized"] and named["name"] == f"{shim} (SOUP_MLX_BLAS)", named
    missing = _python(CHOICE, tmp_path, SOUP_MLX_BLAS=str(tmp_path / "nope.so"))
    assert missing["reason"].startswith(f"SOUP_MLX_BLAS={tmp_path / 'nope.so'}: the library cannot be loaded")
    assert "unset it" in missing["fix"]
    libc = _python(CHOICE, tmp_path, SOUP_MLX_BLAS="libc.so.6")  # loads, but is no BLAS: would do nothing
    assert "defines no cblas_sgemm" in libc["reason"], libc


@needs_cc
def test_soup_train_refuses_a_bad_blas_setting_before_training(
    tmp_path: Path, tiny_model: Path, write_data
) -> None:
    write_data(8)
    config = tmp_path / "soup.yaml"
    config.write_text(f"base: {tiny_model}\nbackend: mlx\noutput: ./output\ndata:\n  train: data.jsonl\n"
                      "training:\n  epochs: 1\n  batch_size: 4\n", encoding="utf-8")
    soup = Path(sys.executable).with_name("soup")

    def train(**env: str) -> tuple[int, str]:
        environ = {k: v for k, v in os.environ.items() if k != "SOUP_MLX_BLAS"}
        environ.update(SOUP_HOME=str(tmp_path / "home"), **env)
        done = subprocess.run([str(soup), "train", "--config", str(config), "--overwrite"], env=environ,
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
        return done.returncode, done.stdout + done.stderr

    bad = {"SOUP_MLX_BLAS": str(tmp_path / "nope.so")}
    code, said = train(**bad)  # a fresh SOUP_HOME: the deep probe runs and refuses too
    assert code == 1 and "SOUP_MLX_BLAS=" in said and "cannot be loaded" in said, said
    assert "Traceback" not in said, said
    assert not (tmp_path / "output").exists()
    code, said = train()
    assert code == 0 and "mlx CPU matmuls: OpenBLAS" in said, said
    code, said = train(**bad)  # the deep probe passed once and is not run again: the pre-flight refuses
    assert code == 1 and "cannot be loaded" in said and "crash bundle" not in said, said
    assert (tmp_path / "output" / "adapter_config.json").exists()  # the earlier run's files are untouched


def test_mlx_imported_first_keeps_its_own_blas_and_the_line_says_what_to_call(tmp_path: Path) -> None:
    got = _python("import mlx.core\n" + CHOICE, tmp_path)
    assert not got["optimized"] and "mlx was imported before Soup could load a BLAS" in got["line"], got
    assert "soup_plugin_mlx.blas.activate() before the first import of mlx" in got["line"], got
