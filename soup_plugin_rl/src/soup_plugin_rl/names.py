"""Names several rl modules share, in a module that imports nothing: registering the config fields reads
them at every ``soup`` start, and the variant table (which imports the capability probes) checks itself
against them."""

from __future__ import annotations

#: ``training.grpo_variant`` values, in the order the README lists them (``variants.VARIANTS`` has one entry
#: per name).
VARIANT_NAMES = ("grpo", "dr_grpo", "dapo", "bnpo", "gspo", "cispo", "sapo", "luspo", "vespo")
