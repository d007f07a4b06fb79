"""Third-party lines that are not the user's business, silenced where Soup imports those libraries.

- bitsandbytes logs "Failed to load CPU gemm_4bit_forward from kernels-community ... pip install kernels" at
  import on every CPU machine without the optional ``kernels`` package; nothing Soup runs needs that kernel,
  and 4-bit training needs a GPU anyway (``soup doctor`` reports bitsandbytes and the GPU).
- transformers warns that ``is_gradient_checkpointing`` is deprecated when trl or peft call it; it is their
  call to change, not the user's.
- peft warns "Could not find a config file in ....gguf" when it saves an adapter whose base is a GGUF file
  (it looks for a config.json there to see whether the vocabulary grew); Soup never resizes the vocabulary.

Only these lines are dropped: any other warning of those libraries still shows. Cheap: no library is imported.
``soup doctor`` reports what matters of them on this installation (:func:`hidden_warnings`), so hiding them
never hides a fact the user needs.
"""

from __future__ import annotations

import logging
import warnings

#: (logger name, text that marks the dropped line): the logger bitsandbytes' CPU backend logs through.
_LOG_LINES = (("bitsandbytes.backends.cpu.ops", "gemm_4bit_forward from kernels-community"),)
#: Regular expressions of the FutureWarning messages dropped.
_FUTURE_WARNINGS = (r"`is_gradient_checkpointing` is deprecated",)
#: ... and of the UserWarning messages.
_USER_WARNINGS = (r"Could not find a config file in .*\.gguf ",)


#: The lines dropped in this process, for :func:`hidden_warnings`.
DROPPED: list[str] = []


class _DropLines(logging.Filter):
    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.marker in message:
            DROPPED.append(message)
            return False
        return True


def silence_third_party_noise() -> None:
    """Drop the lines above (idempotent); call before bitsandbytes, peft or transformers are imported."""
    for name, marker in _LOG_LINES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) and f.marker == marker for f in logger.filters):
            logger.addFilter(_DropLines(marker))
    for message in _FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    for message in _USER_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def hidden_warnings() -> list[dict[str, str]]:
    """Which of the lines above this installation produces, each ``{"source", "hidden", "matters"}``: what
    Soup hides and what it means for the user. Imports bitsandbytes and transformers (for ``soup doctor``)."""
    import importlib.util

    silence_third_party_noise()
    found = []
    if importlib.util.find_spec("bitsandbytes") is not None:
        try:
            import bitsandbytes  # noqa: F401 - its import logs the line (into DROPPED)
        except Exception:  # noqa: BLE001 - a broken bitsandbytes is the dependency check's to report
            pass
        line = next((m for m in DROPPED if _LOG_LINES[0][1] in m), None)
        if line:
            found.append({"source": "bitsandbytes", "hidden": line.splitlines()[0],
                          "matters": "its fast CPU 4-bit kernel is not installed; only 4-bit quantisation on the "
                                     "CPU uses it (training on a GPU does not): pip install kernels adds it"})
    try:
        import transformers
    except Exception:  # noqa: BLE001 - no transformers: nothing of it to hide
        return found
    warned = _is_gradient_checkpointing_warning(transformers)
    if warned:
        callers = [name for name in ("peft", "trl") if _source_mentions(name, "is_gradient_checkpointing")]
        found.append({"source": f"transformers {transformers.__version__}", "hidden": f"FutureWarning: {warned}",
                      "matters": (f"{' and '.join(callers) or 'a library'} still read it during training; "
                                  "nothing to change in your config, but upgrade them with transformers 6")})
    return found


def _is_gradient_checkpointing_warning(transformers: object) -> str | None:
    """The FutureWarning transformers' ``is_gradient_checkpointing`` gives, or None when it gives none."""
    prop = getattr(getattr(transformers, "PreTrainedModel", None), "is_gradient_checkpointing", None)
    if not isinstance(prop, property) or prop.fget is None:
        return None

    class _Model:  # the property reads only this of the model
        is_activation_checkpointing = False

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            prop.fget(_Model())
        except Exception:  # noqa: BLE001 - a property that needs more of a model warned first, or not at all
            pass
    return next((str(w.message) for w in seen
                 if issubclass(w.category, FutureWarning) and "is_gradient_checkpointing" in str(w.message)), None)


def _source_mentions(package: str, text: str) -> bool:
    """Whether an installed package's own source reads ``text`` (without importing it)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for path in Path(folder).rglob("*.py"):
            try:
                if text in path.read_text(encoding="utf-8", errors="ignore"):
                    return True
            except OSError:
                continue
    return False
