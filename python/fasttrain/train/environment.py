"""The run's environment from its [env] section: a built-in task, a plug-in, or `name = "dataset"`
with its dataset and reward functions (errors in those become ConfigErrors naming the key)."""
from __future__ import annotations

from fasttrain.envs import Environment
from fasttrain.tasks import load_env
from fasttrain.train.config import Config, ConfigError

__all__ = ["load_run_env"]


def load_run_env(cfg: Config) -> Environment:
    from fasttrain.envs.dataset import DatasetError
    from fasttrain.envs.reward_functions import RewardSpecError
    from fasttrain.envs.reasoning_gym import ReasoningGymError
    try:
        return load_env(cfg.env.name, **cfg.env.load_kwargs())
    except (DatasetError, RewardSpecError, ReasoningGymError) as e:
        raise ConfigError(str(e)) from None
