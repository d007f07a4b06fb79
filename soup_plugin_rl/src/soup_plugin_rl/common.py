"""What every rl trainer shares: the live β coefficient, the reference by disabled adapters, the
training rows as a ``datasets.Dataset`` that keeps each row's index.

Imported only when a trainer is built (it imports torch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from soup_core.default_plugins.transformers import BackendError


class LiveBeta:
    """``beta`` as a coefficient a controller may change between steps (``SetCoefficient("beta", v)``).

    trl's trainers read ``self.beta`` in every loss computation, so the new value takes effect on the next
    micro-batch. Values the loss cannot take are refused with the reason: below zero anywhere; zero where
    the task divides by it or needs it positive (``soup_beta_positive``); zero → positive where the run
    started without the reference log-probabilities a KL term needs.
    """

    soup_coefficients: tuple[str, ...] = ("beta",)
    soup_beta_positive: bool = True

    @property
    def beta(self) -> float:
        return self.__dict__["_soup_beta"]

    @beta.setter
    def beta(self, value: float) -> None:
        value = float(value)
        first = "_soup_beta" not in self.__dict__
        if value < 0 or (value == 0 and self.soup_beta_positive):
            raise BackendError(
                f"beta must be {'above' if self.soup_beta_positive else 'at least'} 0, got {value}"
            )
        if not first and self.__dict__["_soup_beta"] == 0 and value != 0:
            raise BackendError(
                "beta cannot change from 0 to a positive value during a run: a run started with "
                "training.beta: 0 computes no reference log-probabilities; start with a positive "
                "training.beta"
            )
        self.__dict__["_soup_beta"] = value


def fresh_adapter(model: Any) -> bool:
    """True when the model's active LoRA adapter is freshly initialised (every ``lora_B`` is zero), so the
    base with adapters disabled computes exactly what the adapter computes."""
    found = False
    for name, param in model.named_parameters():
        if "lora_B" in name and ".default." in name:
            found = True
            if bool(param.detach().abs().sum() != 0):
                return False
    return found


def use_disabled_adapters_as_reference(trainer: Any, report: Any) -> str:
    """Make the reference "the base with the adapter disabled", with no copy in memory.

    trl, given a PEFT model it did not wrap itself, copies the adapter into a second adapter named ``ref``
    and scores the reference with it. For a fresh adapter that copy computes exactly what the base with
    adapters disabled computes, so it is deleted and trl falls back to disabling the adapters. A
    pre-trained adapter keeps trl's copy (the reference is then the adapter as it was at the start).
    Returns a line for the user.
    """
    model = trainer.accelerator.unwrap_model(trainer.model)
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, Mapping):
        return "reference: a separate copy of the base (full fine-tuning has no adapter to disable)"
    if "ref" not in peft_config:
        return "reference: the base with the adapter disabled"
    if fresh_adapter(model):
        model.delete_adapter("ref")
        return "reference: the base with the adapter disabled (no second copy in memory)"
    if any(p.is_meta for name, p in model.named_parameters() if ".ref." in name):
        # PEFT puts a new adapter on its base layer's device, and a streamed model's base layers are on the
        # meta device: trl's copy holds no values, so the reference would be garbage or fail mid-step.
        raise BackendError(
            "the reference for a pre-trained adapter is trl's copy of it, and that copy cannot live in a "
            "model whose base layers are streamed; set training.stream_layers: false, or start from a fresh "
            "adapter"
        )
    report("reference: the adapter as loaded (a pre-trained adapter), kept as trl's 'ref' adapter copy")
    return "reference: trl's copy of the pre-trained adapter"


def rows_with_index(rows: Sequence[Mapping[str, Any]]) -> Any:
    """The rows as a ``datasets.Dataset`` with a ``row_index`` column (the row's position)."""
    from datasets import Dataset

    return Dataset.from_list([{**row, "row_index": i} for i, row in enumerate(rows)])


def check_no_row_dropped(dataset: Any, n_rows: int, what: str, max_length: int) -> None:
    """trl drops a pair whose prompt alone fills ``max_length``; that would shift every later row's index,
    so the run stops and names the first such row."""
    kept = list(dataset["row_index"]) if dataset is not None else []
    if kept == list(range(n_rows)):
        return
    dropped = sorted(set(range(n_rows)) - set(kept))
    first = dropped[0] if dropped else "?"
    raise BackendError(
        f"{what} row {first}: its prompt alone fills data.max_length ({max_length} tokens), so trl drops it "
        f"({len(dropped)} row(s) in all); raise data.max_length or shorten those prompts"
    )


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """No ``datasets`` progress bars while trl prepares the rows (they flood a log that is not a TTY)."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


#: trl's training metrics the tracker records for GRPO (a name ending in ``/`` covers its family).
GRPO_METRICS = ("reward", "reward_std", "rewards/", "frac_reward_zero_std", "kl", "clip_ratio/",
                "cispo_clip_ratio", "entropy")
#: ... and for the preference tasks: the implicit rewards of each side, their margin, the pair accuracy.
PREFERENCE_METRICS = ("rewards/",)


def trl_step_metrics(trainer: Any, names: Sequence[str]) -> dict[str, float]:
    """The mean of each of trl's training metrics in ``names`` over the values it appended since the last
    call (one optimizer step), read from ``trainer._metrics["train"]`` before trl's own logging clears it.

    trl replaces a metric's list when it logs; the list object itself is kept to tell a new list from an
    old one that grew.
    """
    store = (getattr(trainer, "_metrics", None) or {}).get("train") or {}
    seen: dict[str, tuple[Any, int]] = trainer.__dict__.setdefault("_soup_trl_seen", {})
    out: dict[str, float] = {}
    for key, values in list(store.items()):
        if not any(key == n or (n.endswith("/") and key.startswith(n)) for n in names):
            continue
        before, count = seen.get(key, (None, 0))
        new = list(values[count:] if before is values else values)
        seen[key] = (values, len(values))
        numbers = [float(v) for v in new if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numbers:
            out[key] = sum(numbers) / len(numbers)
    return out
