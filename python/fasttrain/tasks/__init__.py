"""fasttrain.tasks — built-in tasks as a dataset plus reward functions with TRL's signature.

    countdown    reach a target from given numbers with + - * / (rewards `answer`, `format`);
                 data: countdown_train.jsonl, countdown_probe.jsonl; recipe: countdown.toml
"""
