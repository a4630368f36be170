"""fasttrain.train — the trainer: config, loop, checkpoints/resume, probe + selection, export.

    from fasttrain.train import load_config, Trainer
    cfg = load_config("cispo_repo_r", ["run.steps=50"])     # bundled recipe or a .toml path
    result = Trainer(cfg).train()                            # runs/<run-id>/ (docs/design.md, "The run folder")
    Trainer.resume("runs/<run-id>").train()                  # continue from the last checkpoint
"""
from fasttrain.train.config import Config, ConfigError, config_to_toml, list_recipes, load_config
from fasttrain.train.trainer import Trainer, TrainingStopped

__all__ = ["Config", "ConfigError", "Trainer", "TrainingStopped", "config_to_toml", "list_recipes", "load_config"]
