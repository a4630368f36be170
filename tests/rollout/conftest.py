import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # chi_square.py, the distribution tests' shared statistics


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(one_thread_for_tiny_models):
    """Every test here runs a tiny model: one thread unless marked slow (see tests/conftest.py)."""
