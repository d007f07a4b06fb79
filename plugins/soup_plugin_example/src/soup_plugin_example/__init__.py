"""soup-plugin-example: the template a third party copies to publish a Soup task plugin.

It adds the ``weighted_sft`` task: supervised fine-tuning where every training row carries a loss
weight (the ``weighted`` data format), so that some rows count more than others. Its parts:

- :mod:`soup_plugin_example.plugin` — the hooks Soup calls (the entry point names this module);
- :mod:`soup_plugin_example.formats` — the ``weighted`` data format (pure Python);
- :mod:`soup_plugin_example.task` — the task: which data it reads and how it builds its trainer;
- :mod:`soup_plugin_example.loss` — the weighted loss (torch, imported when a run needs it);
- :mod:`soup_plugin_example.trainer` — the trainer, on the core's ``SoupTrainerMixin`` so the run
  reports per-row losses and ``soup rewind`` works on it.

Everything here imports only soup-core's public API (``soup_core`` and ``soup_core.hookspecs`` /
``contracts`` / ``events`` / ``probes`` / ``testing``); a test checks it.
"""
