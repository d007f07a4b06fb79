"""An optimized BLAS under mlx on a Linux CPU.

mlx's Linux CPU wheel (``mlx[cpu]``) links the reference BLAS (netlib's ``libblas``), and every float32 matmul
of a CPU training step goes through its ``cblas_sgemm``: about 20x slower than OpenBLAS on the same core. mlx
takes exactly three symbols from that library (``cblas_sgemm``, ``cblas_dgemm``, ``cblas_cgemm``; the rest is
LAPACK) and its ``libmlx.so`` is not linked ``-Bsymbolic``, so a library that defines them and is loaded into
the process's global scope *before* ``mlx.core`` is imported is the one mlx calls.

The ``scipy-openblas32`` wheel (a dependency of this plugin on Linux) carries OpenBLAS, but under prefixed
names (``scipy_cblas_sgemm``), so loading it alone changes nothing. :func:`activate` builds, once, a
three-function shim that defines the standard names and calls the prefixed ones (``cc``, well under a second),
caches it under ``SOUP_HOME/cache/mlx-blas/`` and loads it ``RTLD_GLOBAL``. Results are OpenBLAS's (the same
float32 GEMM up to summation order; a run is as repeatable as before). Threads: OpenBLAS's own setting
(``OPENBLAS_NUM_THREADS``, else ``OMP_NUM_THREADS``, else every core).

``SOUP_MLX_BLAS`` chooses: unset or ``auto`` (the above), ``off`` (mlx's own BLAS), or the path of a library
that exports ``cblas_sgemm`` under its standard name (for example Debian's
``/usr/lib/x86_64-linux-gnu/libopenblas.so.0``). Nothing here applies on macOS, where mlx uses Accelerate.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from soup_plugin_mlx.errors import MLXBackendError

ENV = "SOUP_MLX_BLAS"
#: the shim's file name inside its cache folder
SHIM_NAME = "libsoupblas.so"
#: the shim's C source: the three standard names mlx imports, each calling scipy-openblas32's prefixed one
SHIM_SOURCE = """\
/* Written by soup_plugin_mlx.blas: cblas_{s,d,c}gemm under their standard names, calling scipy-openblas32. */
typedef int blasint;
void scipy_cblas_sgemm(int, int, int, blasint, blasint, blasint, float, const float *, blasint,
                       const float *, blasint, float, float *, blasint);
void scipy_cblas_dgemm(int, int, int, blasint, blasint, blasint, double, const double *, blasint,
                       const double *, blasint, double, double *, blasint);
void scipy_cblas_cgemm(int, int, int, blasint, blasint, blasint, const void *, const void *, blasint,
                       const void *, blasint, const void *, void *, blasint);
void cblas_sgemm(int o, int ta, int tb, blasint m, blasint n, blasint k, float alpha, const float *a,
                 blasint lda, const float *b, blasint ldb, float beta, float *c, blasint ldc) {
  scipy_cblas_sgemm(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void cblas_dgemm(int o, int ta, int tb, blasint m, blasint n, blasint k, double alpha, const double *a,
                 blasint lda, const double *b, blasint ldb, double beta, double *c, blasint ldc) {
  scipy_cblas_dgemm(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void cblas_cgemm(int o, int ta, int tb, blasint m, blasint n, blasint k, const void *alpha, const void *a,
                 blasint lda, const void *b, blasint ldb, const void *beta, void *c, blasint ldc) {
  scipy_cblas_cgemm(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""
#: mlx[cpu]'s own BLAS, in words
STOCK = "the reference BLAS mlx[cpu] ships"
#: what a user does to get the optimized BLAS when :func:`activate` could not
FIX = (f"pip install scipy-openblas32 and a C compiler (apt install gcc), or set {ENV} to an OpenBLAS "
       "library (apt install libopenblas0-pthread: /usr/lib/x86_64-linux-gnu/libopenblas.so.0)")


@dataclass(frozen=True)
class BlasChoice:
    """The BLAS mlx's CPU matmuls run on in this process."""

    optimized: bool
    name: str  # in words: "OpenBLAS 0.3.34 (scipy-openblas32)"
    why: str = ""  # when not optimized on Linux: why not, for the run's log line
    fix: str = FIX  # empty where there is nothing to fix (the user turned it off)
    library: Path | None = None

    def line(self) -> str:
        """The run log's line about it."""
        if self.optimized or not self.why:
            return f"mlx CPU matmuls: {self.name}"
        if not self.fix:
            return f"mlx CPU matmuls: {self.name} ({self.why})"
        return f"mlx CPU matmuls: {self.name}, about 20x slower than OpenBLAS ({self.why}; fix: {self.fix})"


_chosen: BlasChoice | None = None


def activate() -> BlasChoice:
    """Load the BLAS ``SOUP_MLX_BLAS`` chooses into the global scope, before mlx is imported; idempotent (the
    first call decides for the process). Raises :class:`BlasSettingError` for a ``SOUP_MLX_BLAS`` path that
    cannot be loaded or defines no ``cblas_sgemm``: a setting that would silently do nothing."""
    global _chosen
    if _chosen is None:
        _chosen = _choose()
    return _chosen


def _choose() -> BlasChoice:
    setting = os.environ.get(ENV, "").strip()
    if not sys.platform.startswith("linux"):
        return BlasChoice(optimized=True, name="the platform's (Accelerate on macOS)")
    if setting.lower() in ("off", "none", "0", "false"):
        return BlasChoice(optimized=False, name=STOCK, why=f"{ENV}={setting}", fix="")
    named = setting and setting.lower() != "auto"
    if "mlx.core" in sys.modules:
        if named:
            _load_named(Path(setting).expanduser())  # still refuse a path that names no BLAS
        return BlasChoice(optimized=False, name=STOCK, why="mlx was imported before Soup could load a BLAS",
                          fix="call soup_plugin_mlx.blas.activate() before the first import of mlx")
    if named:
        return _load_named(Path(setting).expanduser())
    try:
        import scipy_openblas32
    except ImportError:
        return BlasChoice(optimized=False, name=STOCK, why="scipy-openblas32 is not installed")
    openblas = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(fullname=True)
    try:
        shim = cached_shim(openblas)
        try:
            ctypes.CDLL(str(shim), mode=os.RTLD_GLOBAL)
        except OSError:  # a cached file that no longer loads (a damaged cache): build it again, once
            shim = build_shim(openblas, shim)
            ctypes.CDLL(str(shim), mode=os.RTLD_GLOBAL)
    except OSError as exc:
        why = f"the OpenBLAS shim could not be built or loaded: {exc}"
        return BlasChoice(optimized=False, name=STOCK, why=why)
    version = scipy_openblas32.__version__.rsplit(".", 2)[0]  # 0.3.34.481.3: OpenBLAS 0.3.34, wheel 481.3
    return BlasChoice(optimized=True, name=f"OpenBLAS {version} (scipy-openblas32)", library=shim)


class BlasSettingError(MLXBackendError):
    """``SOUP_MLX_BLAS`` names a library mlx cannot use; ``reason`` and ``fix`` apart for a probe's report."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason}; {fix}")
        self.reason, self.fix = reason, fix


def _load_named(path: Path) -> BlasChoice:
    try:
        library = ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
    except OSError as exc:
        raise BlasSettingError(f"{ENV}={path}: the library cannot be loaded ({exc})",
                               f"point {ENV} at a BLAS library that exists, or unset it") from None
    if not hasattr(library, "cblas_sgemm"):
        raise BlasSettingError(f"{ENV}={path}: the library defines no cblas_sgemm, so mlx would not use it",
                               f"point {ENV} at a CBLAS library such as libopenblas.so.0, or unset it")
    return BlasChoice(optimized=True, name=f"{path} ({ENV})", library=path)


def cached_shim(openblas: Path) -> Path:
    """The shim for ``openblas`` in Soup's cache, built on first use. Raises OSError when it cannot be built
    (no C compiler, a failed compile, an unwritable cache)."""
    from soup_core import soup_home

    key = hashlib.sha256(f"{openblas.resolve()}\n{SHIM_SOURCE}".encode()).hexdigest()[:16]
    shim = soup_home() / "cache" / "mlx-blas" / key / SHIM_NAME
    if not shim.is_file():
        build_shim(openblas, shim)
    return shim


def build_shim(openblas: Path, dest: Path) -> Path:
    """Compile the shim against ``openblas`` (a ``libscipy_openblas.so``) into ``dest``, with an rpath to its
    folder; written to a temporary name, then renamed, so a reader never sees half a library."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise OSError("no C compiler (cc) on PATH")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        source, built = Path(tmp) / "shim.c", Path(tmp) / SHIM_NAME
        source.write_text(SHIM_SOURCE, encoding="utf-8")
        lib_dir = str(openblas.parent)
        command = [compiler, "-O2", "-shared", "-fPIC", str(source), "-o", str(built), f"-L{lib_dir}",
                   f"-l:{openblas.name}", f"-Wl,-rpath,{lib_dir}"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            raise OSError(f"{Path(compiler).name} exited {done.returncode}: {first}")
        os.replace(built, dest)
    return dest
