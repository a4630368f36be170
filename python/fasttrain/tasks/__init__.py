"""fasttrain.tasks — the built-in tasks, in one home (the layer above fasttrain.envs: each task is
an environment, or a dataset plus reward functions, written against envs' protocol).

    signal       the seed task: a trading-signal expression scored on twelve channels over a frozen
                 synthetic panel, worlds A and B (`env.name = "signal-a"`, the default; `"signal-b"`);
                 the recipe defaults it brings (fasttrain.tasks.signal.ENV_NAME, PRIORITIES)
    countdown    reach a target from given numbers with + - * / (rewards `answer`, `format`);
                 data: countdown_train.jsonl, countdown_probe.jsonl; recipe: countdown.toml
    calculator   countdown with a `calculate(expression)` tool (recipe: tools.toml)
    starter      what `fasttrain init NAME` writes: arithmetic rows, reward functions, a recipe
"""
