"""The distill fields' constrained types (pydantic), imported when a config is validated, not at start-up."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from soup_plugin_distill.bounds import TEMPERATURE_RANGE, WEIGHT_RANGE

TeacherModel = Annotated[str, Field(min_length=1)] | None
Temperature = Annotated[float, Field(ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])]
Weight = Annotated[float, Field(ge=WEIGHT_RANGE[0], le=WEIGHT_RANGE[1])]
