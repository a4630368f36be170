import pytest

from cuda_emu.emulator import SCHEDULES, TWO_SCHEDULES, use_schedule


@pytest.fixture(params=TWO_SCHEDULES)
def schedule(request):
    """Each kernel test runs under two schedules: threads and blocks in order, then shuffled."""
    with use_schedule(request.param):
        yield request.param


@pytest.fixture(params=tuple(SCHEDULES))
def every_schedule(request):
    with use_schedule(request.param):
        yield request.param

