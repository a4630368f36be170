"""Reward functions of the starter task, in the signature of TRL's GRPOTrainer.

Each function gets the batch's `prompts`, `completions` and `completion_ids`, plus every column of
the dataset by name (here `answer`), and returns one number per completion (None: cannot score
it). fasttrain makes each function one reward channel named after it. The same file works in
TRL unchanged: `from rewards import correct, concise` and `GRPOTrainer(reward_funcs=[correct,
concise], ...)`. A function may also be `async def`.
"""
import re


def _text(completion):
    # A plain-text prompt gives text completions; a chat-message prompt gives [{"role", "content"}].
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct(completions, answer, **kwargs):
    """1.0 when the last whole number in the answer is the expected one ("2 x 3 = 6"), else 0.0."""
    scores = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+", _text(completion))
        scores.append(1.0 if numbers and int(numbers[-1]) == int(expected) else 0.0)
    return scores


def concise(completion_ids, **kwargs):
    """Shorter is better: 1.0 for a one-token answer, falling to 0.0 at 32 tokens."""
    return [max(0.0, 1.0 - (len(ids) - 1) / 31) for ids in completion_ids]
