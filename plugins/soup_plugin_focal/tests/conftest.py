"""The core's test kit: ``soup_home``, ``tiny_model``, ``torch_one_thread`` and ``run_training``."""

pytest_plugins = ["soup_core.testing"]
