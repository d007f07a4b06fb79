"""Config field types built with pydantic, named from plugin.py as ``"module:attr"`` so that registering
the fields at every start imports nothing."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator


def _check_buffers(value: int) -> int:
    if value == 1:
        raise ValueError(
            "1 buffer cannot overlap loading the next layer with computing this one "
            "(the layer in use would be "
            "overwritten); use 2 (the default) to 8"
        )
    if not 2 <= value <= 8:
        raise ValueError(f"must be between 2 and 8, got {value}")
    return value


StreamBuffers = Annotated[int, AfterValidator(_check_buffers)]
