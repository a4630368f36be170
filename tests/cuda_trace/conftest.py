import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # fake_cuda.py, gpu_stubs.py, trace_step.py


def pytest_configure(config):
    config.addinivalue_line("markers", "fake_cuda: runs fasttrain's CUDA path on fake CUDA tensors (no GPU needed)")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.fake_cuda)


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(one_thread_for_tiny_models):
    """Every test here runs a tiny model at most: one thread (see tests/conftest.py)."""
