"""The ranges the config enforces for the distillation coefficients (light: no torch), checked again when
a controller changes a coefficient during a run."""

from __future__ import annotations

#: distill_temperature: low enough for near-greedy targets, high enough to flatten any distribution; the
#: kernel stays finite at the low end in fp32, bf16 and fp16 (tested).
TEMPERATURE_RANGE = (0.01, 20.0)
#: distill_weight: 0 is plain cross-entropy, 1 is the divergence alone.
WEIGHT_RANGE = (0.0, 1.0)
