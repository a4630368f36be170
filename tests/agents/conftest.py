import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # agent_files.py, agent_tools.py


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(one_thread_for_tiny_models):
    """Every test here runs a tiny model at most: one thread (see tests/conftest.py)."""
