"""What the mlx modules share: the backend's name and its error. A module of its own, importing nothing,
so that the training loop, the model loader and the optimizer can name them without importing the backend
class, which imports the training loop when a run starts."""

from __future__ import annotations

#: The backend's name (``backend: mlx``), also written into each checkpoint so a resume can check it.
BACKEND_NAME = "mlx"


class MLXBackendError(RuntimeError):
    """A run on the mlx backend cannot go on for a reason the user can fix (what, where, how)."""
