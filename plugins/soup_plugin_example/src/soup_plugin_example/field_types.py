"""The weighted_sft fields' constrained types (pydantic), imported when a config is validated, not at
start-up (the plugin names them as ``"module:attr"``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

PositiveWeightOrNone = Annotated[float, Field(gt=0)] | None
