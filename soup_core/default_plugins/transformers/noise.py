"""Third-party lines that are not the user's business, silenced where Soup imports those libraries.

- bitsandbytes logs "Failed to load CPU gemm_4bit_forward from kernels-community ... pip install kernels" at
  import on every CPU machine without the optional ``kernels`` package; nothing Soup runs needs that kernel,
  and 4-bit training needs a GPU anyway (``soup doctor`` reports bitsandbytes and the GPU).
- transformers warns that ``is_gradient_checkpointing`` is deprecated when trl or peft call it; it is their
  call to change, not the user's.

Only these lines are dropped: any other warning of those libraries still shows. Cheap: no library is imported.
"""

from __future__ import annotations

import logging
import warnings

#: (logger name, text that marks the dropped line): the logger bitsandbytes' CPU backend logs through.
_LOG_LINES = (("bitsandbytes.backends.cpu.ops", "gemm_4bit_forward from kernels-community"),)
#: Regular expressions of the FutureWarning messages dropped.
_FUTURE_WARNINGS = (r"`is_gradient_checkpointing` is deprecated",)


class _DropLines(logging.Filter):
    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def filter(self, record: logging.LogRecord) -> bool:
        return self.marker not in record.getMessage()


def silence_third_party_noise() -> None:
    """Drop the lines above (idempotent); call before bitsandbytes, peft or transformers are imported."""
    for name, marker in _LOG_LINES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) and f.marker == marker for f in logger.filters):
            logger.addFilter(_DropLines(marker))
    for message in _FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
