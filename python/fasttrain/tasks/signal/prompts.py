"""Prompt specifications for the signal environment: 500 training specs and a frozen probe of
50 unseen ones, generated from templates by a seeded generator.

A spec fixes a style (flavour text), the allowed fields, the secondary horizon and an operator
budget. Bump PROMPT_VERSION whenever templates or seeds change: recipes record
`f"{PROMPT_VERSION}/{split}"` and the prompt ids, so a run names exactly what it trained on.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from fasttrain.envs.protocol import Prompt
from fasttrain.tasks.signal.lang import count_nodes, fields_used, parse

# v2: three example answers; v3: the examples shown use only the fields the prompt allows
PROMPT_VERSION = "signal-prompts-v3"
N_TRAIN, N_PROBE = 500, 50
_SEEDS = {"train": 1_000_003, "probe": 2_000_029}

STYLES = {
    "reversal": "short-term mean reversion: assets that moved too far recently tend to come back",
    "momentum": "slow momentum: trends over several months tend to persist",
    "volume": "volume-driven: unusual trading activity carries information",
    "volatility": "volatility-aware: risk and its changes matter",
    "price-shape": "intraday price shape: where the close sits between the day's high and low",
    "open": "open-ended: any idea that predicts next-day relative returns",
}
FIELD_SETS = (
    ("close", "returns"),
    ("close", "volume"),
    ("close", "volume", "returns"),
    ("open", "high", "low", "close"),
    ("open", "high", "low", "close", "volume", "returns"),
    ("returns", "volume"),
)
HORIZONS = (1, 3, 5, 10, 20)
BUDGETS = (6, 8, 10, 12, 16, 20)
# Example answers, in the order they are offered: each prompt shows the first three that use only
# the fields it allows and fit its budget (every field set and budget above admits three). Three, not one: measured with SmolLM2-135M-Instruct
# (prefilled "<signal>", temperature 0.7, 32 answers), a single example was copied verbatim by nearly
# every valid answer, so a group's answers tied on every channel and GDPO had nothing to rank. And
# only allowed fields: an example the prompt forbids teaches an answer the verifier rejects.
EXAMPLES = ("rank(ts_mean(volume, 10))", "-ts_delta(close, 5)", "zscore(ts_std(returns, 20))",
            "(close - low) / (high - low)", "-ts_mean(returns, 5)", "zscore(ts_std(close, 20))",
            "-ts_rank(high - low, 10)")
N_EXAMPLES = 3
OPERATORS = ("+ - * /, abs(x), log(x), sign(x), rank(x), zscore(x) (across assets), "
             "ts_mean(x, n), ts_std(x, n), ts_delta(x, n), ts_rank(x, n), ts_corr(x, y, n), "
             "delay(x, n) (over the last n days, n an integer from 1 to 60)")


@lru_cache(maxsize=None)
def examples_for(fields: tuple[str, ...], budget: int) -> tuple[str, ...]:
    """The example answers of a prompt that allows `fields` and `budget` nodes: the first three of
    EXAMPLES within both (the language's own parser says which fields and how many nodes)."""
    out = tuple(e for e in EXAMPLES
                if fields_used(parse(e)) <= set(fields) and count_nodes(parse(e)) <= budget)[:N_EXAMPLES]
    if len(out) < N_EXAMPLES:
        raise ValueError(f"fields {fields} with budget {budget} admit only {len(out)} of the example answers")
    return out


def _spec_text(style: str, fields: tuple[str, ...], horizon: int, budget: int, answer_format: str) -> str:
    return (
        "Write a trading signal for a daily panel of 200 stocks. The signal is one expression; "
        "each day, stocks with a higher value are bought and lower ones sold short.\n"
        f"Style: {STYLES[style]}.\n"
        f"Fields you may use: {', '.join(fields)}.\n"
        f"Operators: {OPERATORS}.\n"
        f"Secondary horizon: {horizon} day{'s' if horizon > 1 else ''}. "
        f"Use at most {budget} operators, fields and numbers.\n"
        f"{answer_format} For example {_example_list(examples_for(fields, budget))}."
    )


def _example_list(examples: tuple[str, ...]) -> str:
    tagged = [f"<signal>{e}</signal>" for e in examples]
    return ", ".join(tagged[:-1]) + " or " + tagged[-1]


def make_prompts(split: str, answer_format: str, prefix: str) -> list[Prompt]:
    """Deterministic prompts for `split` ('train' or 'probe'); probe specs never occur in train."""
    if split not in _SEEDS:
        raise ValueError(f"unknown prompt split {split!r}; expected 'train' or 'probe'")
    train_keys: set[tuple] = set()
    if split == "probe":
        train_keys = {p.fields["key"] for p in make_prompts("train", answer_format, prefix)}
    rng = np.random.default_rng(_SEEDS[split])
    styles = sorted(STYLES)
    out: list[Prompt] = []
    n = N_TRAIN if split == "train" else N_PROBE
    # the spec space has 6·6·5·6 = 1080 combinations; train draws 500 of them with repeats
    # allowed, the probe draws only combinations train never used ("unseen specifications")
    while len(out) < n:
        key = (styles[rng.integers(len(styles))], int(rng.integers(len(FIELD_SETS))),
               HORIZONS[rng.integers(len(HORIZONS))], BUDGETS[rng.integers(len(BUDGETS))])
        if key in train_keys or (split == "probe" and any(p.fields["key"] == key for p in out)):
            continue
        style, fset, horizon, budget = key
        fields = FIELD_SETS[fset]
        out.append(Prompt(
            id=f"{prefix}/{PROMPT_VERSION}/{split}/{len(out):04d}",
            spec=_spec_text(style, fields, horizon, budget, answer_format),
            fields={"key": key, "style": style, "allowed_fields": fields,
                    "horizon": horizon, "budget": budget},
        ))
    return out
