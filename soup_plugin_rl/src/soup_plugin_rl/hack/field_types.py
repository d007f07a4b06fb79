"""The reward-hack fields' constrained types, imported when a config is validated (annotated_types alone
costs milliseconds that every ``soup`` start would pay)."""

from __future__ import annotations

from typing import Annotated

from annotated_types import Ge, Gt, Le, Lt

Fraction = Annotated[float, Gt(0), Le(1)]
OpenFraction = Annotated[float, Ge(0), Lt(1)]
OpenUnit = Annotated[float, Gt(0), Lt(1)]
Positive = Annotated[float, Gt(0)]
NonNegative = Annotated[float, Ge(0)]
Count = Annotated[int, Ge(1), Le(100_000)]
Window = Annotated[int, Ge(2), Le(256)]
Gain = Annotated[float, Gt(1), Le(100)]
