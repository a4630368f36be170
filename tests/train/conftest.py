import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """Stand-ins for pieces not on main yet + the tiny world importable as `tiny_world`."""
    monkeypatch.syspath_prepend(str(HERE))
    import standins
    standins.install(monkeypatch)
    return tmp_path


@pytest.fixture
def tiny_recipe():
    return make_tiny_recipe


def make_tiny_recipe(out: Path, **over) -> dict:
    r = {
        "run": {"name": "tiny", "seed": 7, "steps": 4, "out": str(out), "device": "cpu", "threads": 1},
        "policy": {"model": "tiny_world:tiny_policy", "dtype": "float32", "quantize": "nf4",
                   "rank": 4, "alpha": 8.0, "gradient_checkpointing": True},
        "env": {"name": "tiny_world:make_env"},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8},
        "advantages": {"priorities": {"core": 3.0}, "floor": -1e9},
        "loss": {"kind": "cispo", "repo_r": True, "passes": 2, "token_mask": "all", "thermostat_warmup": 2},
        "optim": {"lr": 1e-2, "micro_batch": 3},
        "probe": {"every": 2, "prompts": 3},
    }
    for k, v in over.items():
        sec, key = k.split(".")
        r.setdefault(sec, {})[key] = v
    return r
