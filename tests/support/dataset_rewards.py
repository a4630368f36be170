"""Reward functions for the dataset-environment tests, written in TRL's GRPOTrainer signature
(the TRL parity test hands this very file to TRL). Some misbehave on purpose, keyed by words in
the completion: "raise", "none", "nan", "inf", "str", "hang", "die"."""
import asyncio
import math
import os
import time


def _text(completion):
    return completion if isinstance(completion, str) else completion[-1]["content"]


def matches(prompts, completions, answer, **kwargs):
    """1.0 when the completion contains the row's answer."""
    return [1.0 if str(a) in _text(c) else 0.0 for c, a in zip(completions, answer)]


async def shorter(completions, completion_ids, **kwargs):
    """Minus the number of completion tokens (async on purpose)."""
    await asyncio.sleep(0)
    return [-float(len(ids)) for ids in completion_ids]


def chat_shape(prompts, completions, **kwargs):
    """Depends on the layout TRL uses: 10 x (messages in the prompt) + 1 for a one-message
    assistant completion, or the number of words of a text completion."""
    out = []
    for p, c in zip(prompts, completions):
        if isinstance(p, list):
            ok = isinstance(c, list) and len(c) == 1 and c[0]["role"] == "assistant"
            out.append(10.0 * len(p) + (1.0 if ok else 0.0))
        else:
            out.append(float(len(c.split())) if isinstance(c, str) else -100.0)
    return out


def picky(completions, **kwargs):
    out = []
    for c in completions:
        t = _text(c)
        if "raise" in t:
            raise ValueError(f"picky cannot read {t!r}")
        out.append(None if "none" in t else math.nan if "nan" in t else math.inf if "inf" in t
                   else "x" if "str" in t else 1.0)
    return out


def stuck(completions, **kwargs):
    if any("hang" in _text(c) for c in completions):
        while True:          # a busy loop: a thread could never be stopped
            pass
    if any("die" in _text(c) for c in completions):
        os._exit(3)
    return [0.5] * len(completions)


async def stuck_async(completions, **kwargs):
    if any("hang" in _text(c) for c in completions):
        await asyncio.sleep(3600)
    return [0.25] * len(completions)


def sleepy(completions, **kwargs):
    if any("hang" in _text(c) for c in completions):
        time.sleep(3600)
    return [0.0] * len(completions)


def unreliable(completion_ids, **kwargs):
    """By the first token id mod 4: raise, None, NaN, or 1.0 (for the end-to-end run)."""
    if any(ids and ids[0] % 4 == 0 for ids in completion_ids):
        raise RuntimeError("unreliable")
    return [None if ids and ids[0] % 4 == 1 else math.nan if ids and ids[0] % 4 == 2 else 1.0
            for ids in completion_ids]


def hangs_on_big_batches(completions, **kwargs):
    if len(completions) > 4:
        time.sleep(3600)
    return [0.0] * len(completions)


def ground_truth_equal(completions, ground_truth, **kwargs):
    return [1.0 if _text(c).strip() == str(g) else 0.0 for c, g in zip(completions, ground_truth)]


def hungry(completions, **kwargs):
    """Allocates without bound when a completion says "hog" (a leak, or a runaway answer)."""
    held = []
    while any("hog" in _text(c) for c in completions):
        held.append(b"\1" * (32 << 20))
        time.sleep(0.005)
    return [0.5] * len(completions)
