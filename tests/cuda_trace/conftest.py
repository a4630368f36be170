import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "fake_cuda: runs fasttrain's CUDA path on fake CUDA tensors (no GPU needed)")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.fake_cuda)
