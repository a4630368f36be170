import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture
def worlds(monkeypatch):
    """tiny_world (tests/train) and padded_world (here) importable by recipes."""
    monkeypatch.syspath_prepend(str(HERE.parent / "train"))
    monkeypatch.syspath_prepend(str(HERE))
    return HERE


@pytest.fixture(autouse=True)
def _one_thread(one_thread_for_tiny_models):
    yield
