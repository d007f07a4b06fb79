"""soup-plugin-streaming: fine-tune a model whose frozen base does not fit in memory, bit-exact against a
resident run, by streaming its decoder layers through a small pool of buffers.

The entry point is :mod:`soup_plugin_streaming.plugin` (registered as the ``streaming`` plugin). The torch
half lives in :mod:`~soup_plugin_streaming.store`, :mod:`~soup_plugin_streaming.pool`,
:mod:`~soup_plugin_streaming.runtime`, :mod:`~soup_plugin_streaming.nf4` and (CUDA only)
:mod:`~soup_plugin_streaming.cuda`; importing this package imports none of them.
"""

from __future__ import annotations

__version__ = "0.1.0"
