"""Soup's default plugins: the parts of Soup that register through the same hooks a third party uses.

The plugin manager loads them first, as ``core.*``, and they cannot be disabled. Each is a plain plugin module:

- ``core.transformers``: :mod:`soup_core.default_plugins.transformers` (the backend, the trainer base a task
  plugin extends, the tiny local model builder);
- ``core.sft``: :mod:`soup_core.default_plugins.sft` (the ``sft`` task and its tokenisation);
- ``core.formats``: :mod:`soup_core.default_plugins.formats` (chat, alpaca, prompt_completion, text);
- ``core.tracker``: :mod:`soup_core.default_plugins.tracker` (the tracker recorder and ``soup runs``);
- ``core.cli``: :mod:`soup_core.default_plugins.commands` (quickstart, init, train, merge, plugins, doctor).

A plugin subclasses their classes by importing them from these modules (docs/plugins.md).
"""
