"""Curves as pictures: the matplotlib drawing ``soup rewind --plot-file`` and ``soup runs plot`` (plugin observe)
share. matplotlib is imported when a picture is drawn (``pip install matplotlib``); ImportError without it."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import NamedTuple


class Line(NamedTuple):
    label: str
    steps: Sequence[int]
    values: Sequence[float | None]
    dashed: bool = False


class Marks(NamedTuple):
    """Points drawn over the lines (spikes): ``top`` puts them at the panel's highest value (non-finite steps)."""

    label: str
    steps: Sequence[int]
    values: Sequence[float]
    color: str
    marker: str = "o"
    top: bool = False


class Panel(NamedTuple):
    ylabel: str
    lines: Sequence[Line]
    marks: Sequence[Marks] = ()
    log_y: bool = False


def png(panels: Sequence[Panel], *, width: float = 10.0, height: float = 4.0) -> bytes:
    """The panels stacked, sharing the step axis, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(width, height * len(panels)), dpi=100, sharex=True,
                             squeeze=False)
    try:
        for ax, panel in zip(axes[:, 0], panels, strict=True):
            top = 1.0
            for line in panel.lines:
                pairs = [(s, v) for s, v in zip(line.steps, line.values, strict=False)
                         if v is not None and math.isfinite(v)]
                if pairs:
                    top = max(top, max(v for _, v in pairs))
                    ax.plot([s for s, _ in pairs], [v for _, v in pairs], linewidth=1, label=line.label,
                            linestyle="--" if line.dashed else "-", marker="o" if len(pairs) < 30 and line.dashed
                            else None)
            for mark in panel.marks:
                if mark.steps:
                    ys = [top] * len(mark.steps) if mark.top else list(mark.values)
                    ax.scatter(list(mark.steps), ys, color=mark.color, marker=mark.marker, zorder=3, label=mark.label)
            if panel.log_y:
                ax.set_yscale("log")
            ax.set_ylabel(panel.ylabel)
            ax.legend(loc="upper right")
        axes[-1, 0].set_xlabel("step")
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return buf.getvalue()
