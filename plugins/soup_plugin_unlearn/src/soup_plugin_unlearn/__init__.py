"""soup-plugin-unlearn: the ``unlearn`` task (NPO, SimNPO, RMU) for Soup.

Importing this package is light; the losses, trainer and evaluation import torch when imported themselves
(``soup_plugin_unlearn.losses``, ``.trainer``, ``.evaluate``).
"""

from __future__ import annotations

__version__ = "0.1.0"
