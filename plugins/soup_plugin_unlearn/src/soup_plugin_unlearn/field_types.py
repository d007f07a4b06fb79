"""The unlearn fields' constrained types (pydantic), imported when a config is validated, not at start-up."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

PositiveFloat = Annotated[float, Field(gt=0)]
PositiveFloatOrNone = PositiveFloat | None
NonNegativeFloat = Annotated[float, Field(ge=0)]
NonNegativeFloatOrNone = NonNegativeFloat | None
LayerIndexOrNone = Annotated[int, Field(ge=0)] | None
StepCountOrNone = Annotated[int, Field(ge=1)] | None
