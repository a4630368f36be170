"""The tiny world's recipes: the trainer tests' (make_tiny_recipe) and the measured steps' (tiny_recipe:
prompts of different lengths from the padded world)."""
from __future__ import annotations

from pathlib import Path


def make_tiny_recipe(out: Path, **over) -> dict:
    """The tiny world (support.tiny_world) for 4 steps into `out`; over: {"section.key": value}."""
    r = {
        "run": {"name": "tiny", "seed": 7, "steps": 4, "out": str(out), "device": "cpu", "threads": 1},
        "policy": {"model": "support.tiny_world:tiny_policy", "dtype": "float32", "quantize": "nf4",
                   "rank": 4, "alpha": 8.0, "gradient_checkpointing": True},
        "env": {"name": "support.tiny_world:make_env"},
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


def tiny_recipe(out, n: int, G: int, T: int, mb: int) -> dict:
    return {
        "run": {"name": "plan", "seed": 7, "steps": 2, "out": str(out), "device": "cpu", "threads": 1},
        "policy": {"model": "support.tiny_world:tiny_policy", "dtype": "float32", "quantize": "nf4",
                   "rank": 4, "alpha": 8.0, "gradient_checkpointing": True},
        "env": {"name": "support.padded_world:make_env"},
        "rollout": {"prompts_per_step": n, "group_size": G, "max_new_tokens": T},
        "advantages": {"priorities": {"core": 3.0}, "floor": -1e9},
        "loss": {"kind": "cispo", "repo_r": True, "passes": 2, "token_mask": "all", "thermostat_warmup": 2},
        "optim": {"lr": 1e-2, "micro_batch": mb},
        "probe": {"every": 2, "prompts": 3},
    }


def recipe_toml(d: dict) -> str:
    """A recipe dict as the TOML file `fasttrain run` reads (the recipe writer's own value format)."""
    from fasttrain.train.config import _toml_value
    return "\n".join(f"[{s}]\n" + "\n".join(f"{k} = {_toml_value(v)}" for k, v in kv.items()) for s, kv in d.items())
