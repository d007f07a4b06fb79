"""The core's test kit: ``soup_home``, ``tiny_model``, ``tiny_pretrained``, ``torch_one_thread``, ``run_training``."""

pytest_plugins = ["soup_core.testing"]
