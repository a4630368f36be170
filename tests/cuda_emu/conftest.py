import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # emulator.py

from emulator import SCHEDULES, TWO_SCHEDULES, use_schedule  # noqa: E402


@pytest.fixture(params=TWO_SCHEDULES)
def schedule(request):
    """Each kernel test runs under two schedules: threads and blocks in order, then shuffled."""
    with use_schedule(request.param):
        yield request.param


@pytest.fixture(params=tuple(SCHEDULES))
def every_schedule(request):
    with use_schedule(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _one_thread(one_thread_for_tiny_models):
    """The emulator runs on one OS thread; the CPU ops beside it get one too (tiny tensors)."""
    yield
