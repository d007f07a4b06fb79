"""soup-plugin-mlx: the ``mlx`` backend for Soup (Apple MLX + mlx-lm).

Import-light: this package's registration module (:mod:`soup_plugin_mlx.plugin`) imports no mlx; the
training loop imports it when a run starts.
"""

__version__ = "0.1.0"
