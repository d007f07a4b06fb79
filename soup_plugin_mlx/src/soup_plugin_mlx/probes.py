"""Capability probes of the ``mlx`` backend (docs/architecture.md).

The cheap probe looks at installed distributions only (never imports mlx): it runs at every ``soup``
start. The deep probe imports ``mlx.core`` and makes the default device compute; it runs before a run
on ``backend: mlx`` and under ``soup plugins list --check``, and its detail names the device.
"""

from __future__ import annotations

import os
import sys

from soup_core import ProbeResult
from soup_core import probes as soup_probes

#: What to install for this platform: plain ``mlx`` has no CPU library on Linux.
INSTALL = 'pip install "mlx[cpu]" mlx-lm' if sys.platform.startswith("linux") else "pip install mlx mlx-lm"

_LINUX_BUILDS = ("mlx-cpu", "mlx-cuda-12", "mlx-cuda-13")


def expected_device() -> str:
    """The device MLX will pick, guessed from the platform and the installed build (no import)."""
    if sys.platform == "darwin":
        return "gpu (Metal)" if os.uname().machine == "arm64" else "cpu"
    for build in _LINUX_BUILDS[1:]:
        if soup_probes.distribution_version(build):
            return "gpu (CUDA)"
    return "cpu"


def installed() -> ProbeResult:
    """Cheap: mlx (with a build that loads on this platform) and mlx-lm are installed."""
    if not (sys.platform == "darwin" or sys.platform.startswith("linux")):
        return ProbeResult(
            False,
            f"MLX runs on macOS and Linux, not {sys.platform}",
            "use backend: transformers on this machine",
        )
    found = []
    for dist in ("mlx", "mlx-lm"):
        version = soup_probes.distribution_version(dist)
        if version is None:
            return ProbeResult(False, f"{dist} is not installed", INSTALL)
        found.append(f"{dist} {version}")
    if sys.platform.startswith("linux") and not any(
        soup_probes.distribution_version(b) for b in _LINUX_BUILDS
    ):
        return ProbeResult(False, "mlx is installed without its Linux library (mlx-cpu or mlx-cuda)", INSTALL)
    return ProbeResult(True, detail=f"{', '.join(found)} (device: {expected_device()})")


def device_computes() -> ProbeResult:
    """Deep: the default MLX device runs a matmul and gives the right answer; names the device."""
    from soup_plugin_mlx import blas

    try:
        choice = blas.activate()
    except blas.BlasSettingError as exc:
        return ProbeResult(False, exc.reason, exc.fix)
    try:
        import mlx.core as mx
    except Exception as exc:  # noqa: BLE001 - a broken install must read as a failed probe
        return ProbeResult(False, f"mlx does not import: {type(exc).__name__}: {exc}", INSTALL)
    device = mx.default_device()
    got = mx.ones((4, 4)) @ mx.full((4, 4), 2.0)
    mx.eval(got)
    if not bool(mx.all(got == 8.0).item()):
        return ProbeResult(False, f"the MLX device {device} computed a wrong matmul", INSTALL)
    return ProbeResult(True, detail=f"checked: {describe_device()} computes; matmuls on {choice.name}")


def describe_device() -> str:
    """The device MLX trains on, in words (``cpu (AMD EPYC)``, ``gpu (Apple M2)``)."""
    from soup_plugin_mlx import blas

    blas.activate()
    import mlx.core as mx

    device = mx.default_device()
    kind = "gpu" if device.type == mx.gpu else "cpu"
    name = ""
    try:
        name = str(mx.device_info().get("device_name", ""))
    except Exception:  # noqa: BLE001 - the name is a nicety; older mlx has no device_info
        pass
    return f"{kind} ({name})" if name else kind
