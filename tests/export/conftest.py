import pytest


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(one_thread_for_tiny_models):
    """Every test here runs a tiny model: one thread (see tests/conftest.py)."""
