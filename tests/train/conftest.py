import pytest

from support.recipes import make_tiny_recipe


@pytest.fixture
def tiny(tmp_path):
    """A run folder for the tiny world (support.tiny_world: model + environment); every op is the real one."""
    return tmp_path


@pytest.fixture
def tiny_recipe():
    return make_tiny_recipe
