"""The recipe of the measured steps: the tiny world with prompts of different lengths."""


def tiny_recipe(out, n: int, G: int, T: int, mb: int) -> dict:
    return {
        "run": {"name": "plan", "seed": 7, "steps": 2, "out": str(out), "device": "cpu", "threads": 1},
        "policy": {"model": "tiny_world:tiny_policy", "dtype": "float32", "quantize": "nf4",
                   "rank": 4, "alpha": 8.0, "gradient_checkpointing": True},
        "env": {"name": "padded_world:make_env"},
        "rollout": {"prompts_per_step": n, "group_size": G, "max_new_tokens": T},
        "advantages": {"priorities": {"core": 3.0}, "floor": -1e9},
        "loss": {"kind": "cispo", "repo_r": True, "passes": 2, "token_mask": "all", "thermostat_warmup": 2},
        "optim": {"lr": 1e-2, "micro_batch": mb},
        "probe": {"every": 2, "prompts": 3},
    }
