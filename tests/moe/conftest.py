import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread_for_tiny_models):
    """Tiny MoE models: one thread (see tests/conftest.py)."""
    yield
