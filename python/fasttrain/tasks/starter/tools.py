"""A tool of the starter task, in the contract of TRL's GRPOTrainer: a plain function with a type
hint on every argument and a Google-style docstring (its JSON schema, which the model sees, is
built from them by transformers' get_json_schema). The model calls it by writing
<tool_call>{"name": "calculate", "arguments": {"expression": "19 - 6"}}</tool_call>; what it
returns is shown to the model as text, and an exception becomes an error message. The same file
works in TRL unchanged: `from tools import calculate` and `GRPOTrainer(tools=[calculate], ...)`.

It reads the expression with fasttrain's countdown parser: model output is data, never eval-ed.
"""
from fasttrain.tasks.countdown import parse


def calculate(expression: str) -> str:
    """Compute the exact value of an arithmetic expression.

    Args:
        expression: Whole numbers with + - * / and parentheses, for example "(19 - 6) * 2".
    """
    value = parse(expression).value
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
