"""The test kit (``soup_core.testing``) gives the fixtures: ``tiny_model``, ``torch_one_thread`` and a private
``soup_home`` for every test (nothing is written under ~/.soup)."""

from __future__ import annotations

import pytest

pytest_plugins = ["soup_core.testing"]


@pytest.fixture(autouse=True)
def _private_soup_home(soup_home):
    """Every test runs with its own SOUP_HOME."""
