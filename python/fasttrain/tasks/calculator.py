"""The calculator tool of the built-in tool task (`fasttrain run tools`): countdown problems
(fasttrain.tasks.countdown's data and rewards) with a `calculate(expression)` tool the model may
call before it answers, plus a reward for a call that worked.

The tool reads its argument with the countdown parser (closed alphabet, recursive descent, exact
fractions, every limit checked while reading), so a model's expression is data, never code: no
`eval`. It is written to TRL's tool contract (type hints, Google-style docstring), so the same
function goes to TRL's GRPOTrainer as `tools=[calculate]`.
"""
from __future__ import annotations

from typing import Any

from fasttrain.tasks.countdown import parse

__all__ = ["calculate", "used_calculator"]


def calculate(expression: str) -> str:
    """Compute the exact value of an arithmetic expression.

    Args:
        expression: Whole numbers with + - * / and parentheses, for example "(25 + 14) * 2".
    """
    value = parse(expression).value          # raises CountdownError with the reason: an error message
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _worked(message: Any) -> bool:
    return (isinstance(message, dict) and message.get("role") == "tool" and message.get("name") == "calculate"
            and not str(message.get("content", "")).startswith("{'error'"))


def used_calculator(prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
    """1.0 when the conversation holds a calculate call that returned a value, else 0.0 (a text
    completion, without tools, is 0.0)."""
    return [1.0 if isinstance(c, list) and any(_worked(m) for m in c) else 0.0 for c in completions]
