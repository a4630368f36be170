"""Countdown arithmetic: reach a target from given numbers with + - * / and parentheses, each
number used at most once.

What this file is: the problem generator (a pure function of a seed: no download, the same rows on
every machine), the parser that reads a model's answer as data, and two reward functions written
to TRL's reward-function signature, `f(prompts=, completions=, completion_ids=, **columns) ->
list[float | None]` (the layout of TRL's GRPOTrainer reward functions), so the same module trains
in fasttrain's dataset environment and in TRL unchanged:

    answer   1.0 when the answer block holds an expression that uses only the given numbers, each
             at most once, and equals the target exactly; else 0.0
    format   1.0 when the completion has an <answer>...</answer> block that parses as an
             expression; 0.5 when the block is there but does not parse; 0.0 without a block

What it is not: an evaluator of code. Model output is tokenized over a closed alphabet (digits,
+ - * / = and parentheses, with the unicode signs models write: × ÷ −) and parsed by recursive
descent with exact rational arithmetic (fractions.Fraction: 1/10 + 2/10 is 3/10, where floats give
0.30000000000000004).
It is written by hand because `eval` and `ast.literal_eval` are unsafe or do not do arithmetic,
and because every limit below is checked as the text is read, so hostile input (10,000
parentheses, 999999*999999*999999..., a division by zero, a megabyte of text) ends in a
CountdownError before any large work, rather than a hang, a RecursionError or an OverflowError.

Grammar (left-associative, * and / bind tighter than + and -; no unary minus, no concatenation):
    answer := expr ['=' INTEGER]          a stated result must equal the expression's value
    expr   := term (('+' | '-') term)*
    term   := atom (('*' | '/') atom)*
    atom   := INTEGER | '(' expr ')'

The packaged data (countdown_train.jsonl / countdown_probe.jsonl, and the smaller variant's
countdown_small_train.jsonl / countdown_small_probe.jsonl, beside this file) is `write_dataset()`'s
output; `python -m fasttrain.tasks.countdown` writes them again, and a test checks the files
equal the generator's output.
"""
from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Sequence

__all__ = ["CountdownError", "Limits", "Expression", "parse", "check", "answer_block",
           "answer", "format", "make_problem", "generate", "problem_key", "write_dataset", "prompt_text",
           "TRAIN_FILE", "PROBE_FILE", "VARIANTS", "variant_files"]

HERE = Path(__file__).parent
TRAIN_FILE = HERE / "countdown_train.jsonl"
PROBE_FILE = HERE / "countdown_probe.jsonl"

# The packaged variants: name -> how generate() makes them. "countdown" is the original (3 or 4
# numbers in 1..25, targets up to 100); "countdown_small" is sized for a 135M model to learn:
# 2 or 3 numbers in 1..10 and targets up to 20, so half of its problems are one operation on two
# numbers and a group of 8 answers often holds a solution.
VARIANTS: dict[str, dict[str, Any]] = {
    "countdown": {"numbers": (3, 4), "max_number": 25, "max_target": 100},
    "countdown_small": {"numbers": (3,), "max_number": 10, "max_target": 20},
}

OPEN_TAG, CLOSE_TAG = "<answer>", "</answer>"


class CountdownError(ValueError):
    """An answer that is not a valid countdown expression; the message says where and why."""


@dataclass(frozen=True)
class Limits:
    max_chars: int = 200            # an answer block longer than this is refused unread
    max_tokens: int = 80
    max_depth: int = 16             # parenthesis nesting
    max_digits: int = 6             # per integer literal: 999999 at most
    max_magnitude: int = 10**15     # |numerator| and denominator of every intermediate value


DEFAULT_LIMITS = Limits()

# Signs models write for the four operations, mapped to ASCII.
_SIGNS = {"+": "+", "-": "-", "*": "*", "/": "/", "(": "(", ")": ")", "=": "=",
          "×": "*", "x": "*", "X": "*", "·": "*", "÷": "/", "−": "-", "–": "-"}


@dataclass(frozen=True)
class Expression:
    """A parsed answer: its exact value, the integers it uses (in reading order) and the result
    it states after '=' (None when it states none)."""
    value: Fraction
    numbers: tuple[int, ...]
    stated: int | None


def _tokens(text: str, lim: Limits) -> list[tuple[str, int | None, int]]:
    """(kind, integer value or None, position) tokens; kind is 'int' or one ASCII sign."""
    if len(text) > lim.max_chars:
        raise CountdownError(f"answer has {len(text)} characters; at most {lim.max_chars}")
    out: list[tuple[str, int | None, int]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
            continue
        if "0" <= c <= "9":
            j = i
            while j < n and "0" <= text[j] <= "9":
                j += 1
            digits = text[i:j]
            if j - i > lim.max_digits:
                raise CountdownError(f"number at {i} has {j - i} digits; at most {lim.max_digits}")
            if len(digits) > 1 and digits[0] == "0":
                raise CountdownError(f"number at {i} has a leading zero: {digits!r}")
            if j < n and text[j] in ".,":
                raise CountdownError(f"number at {i}: only whole numbers are allowed")
            out.append(("int", int(digits), i))
            i = j
        elif c in _SIGNS:
            out.append((_SIGNS[c], None, i))
            i += 1
        else:
            raise CountdownError(f"unexpected character {c!r} at {i}; allowed: digits, + - * / ( ) =")
        if len(out) > lim.max_tokens:
            raise CountdownError(f"answer has more than {lim.max_tokens} tokens")
    return out


class _Parser:
    def __init__(self, toks: list[tuple[str, int | None, int]], lim: Limits):
        self.toks, self.lim, self.i = toks, lim, 0
        self.numbers: list[int] = []

    def peek(self) -> str | None:
        return self.toks[self.i][0] if self.i < len(self.toks) else None

    def where(self) -> str:
        return f"at {self.toks[self.i][2]}" if self.i < len(self.toks) else "at the end"

    def bounded(self, v: Fraction) -> Fraction:
        if abs(v.numerator) > self.lim.max_magnitude or v.denominator > self.lim.max_magnitude:
            raise CountdownError(f"an intermediate value exceeds {self.lim.max_magnitude:.0e}")
        return v

    def expr(self, depth: int) -> Fraction:
        v = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.peek()
            self.i += 1
            r = self.term(depth)
            v = self.bounded(v + r if op == "+" else v - r)
        return v

    def term(self, depth: int) -> Fraction:
        v = self.atom(depth)
        while self.peek() in ("*", "/"):
            op = self.peek()
            self.i += 1
            r = self.atom(depth)
            if op == "/" and r == 0:
                raise CountdownError("division by zero")
            v = self.bounded(v * r if op == "*" else v / r)
        return v

    def atom(self, depth: int) -> Fraction:
        kind = self.peek()
        if kind == "int":
            value = self.toks[self.i][1]
            assert value is not None
            self.i += 1
            self.numbers.append(value)
            return Fraction(value)
        if kind == "(":
            if depth >= self.lim.max_depth:
                raise CountdownError(f"parentheses nest deeper than {self.lim.max_depth}")
            self.i += 1
            v = self.expr(depth + 1)
            if self.peek() != ")":
                raise CountdownError(f"missing ')' {self.where()}")
            self.i += 1
            return v
        if kind == "-":
            raise CountdownError(f"unary minus {self.where()} is not allowed: use the numbers as given")
        raise CountdownError(f"expected a number or '(' {self.where()}")


def parse(text: str, limits: Limits = DEFAULT_LIMITS) -> Expression:
    """The expression in `text` (the content of an answer block), or CountdownError."""
    if not isinstance(text, str):
        raise CountdownError(f"answer must be text, got {type(text).__name__}")
    toks = _tokens(text, limits)
    if not toks:
        raise CountdownError("empty answer")
    p = _Parser(toks, limits)
    value = p.expr(0)
    stated = None
    if p.peek() == "=":
        p.i += 1
        if p.peek() != "int" or p.i + 1 != len(toks):
            raise CountdownError("'=' must be followed by one whole number and nothing else")
        stated = toks[p.i][1]
        p.i += 1
    if p.i != len(toks):
        pos = toks[p.i][2]
        raise CountdownError(f"unexpected {text[pos:pos + 8]!r} at {pos}: an operator is missing")
    return Expression(value=value, numbers=tuple(p.numbers), stated=stated)


def check(text: str, nums: Sequence[int], target: int, limits: Limits = DEFAULT_LIMITS) -> tuple[bool, str]:
    """(solved, why): does the expression `text` reach `target` using each of `nums` at most once?"""
    try:
        e = parse(text, limits)
    except CountdownError as err:
        return False, f"not an expression: {err}"
    extra = Counter(e.numbers) - Counter(int(n) for n in nums)
    if extra:
        return False, f"uses {sorted(extra.elements())} beyond the given numbers {list(nums)}"
    if e.stated is not None and e.stated != e.value:
        return False, f"states {e.stated} but the expression equals {e.value}"
    if e.value != target:
        return False, f"equals {e.value}, not {target}"
    return True, "solved"


def _completion_text(c: Any) -> str:
    """TRL passes a completion as text, or (conversational data) as a list of messages."""
    if isinstance(c, str):
        return c
    if isinstance(c, (list, tuple)) and c and isinstance(c[-1], dict):
        return str(c[-1].get("content", ""))
    return ""


def answer_block(completion: Any) -> str | None:
    """The text inside the last <answer>...</answer> of a completion, or None. Linear time."""
    text = _completion_text(completion)
    end = text.rfind(CLOSE_TAG)
    if end < 0:
        return None
    start = text.rfind(OPEN_TAG, 0, end)
    if start < 0:
        return None
    return text[start + len(OPEN_TAG):end]


# ---- reward functions (TRL's signature) ---------------------------------------------------------

def answer(prompts=None, completions=None, completion_ids=None, *, nums, target, **kwargs) -> list[float]:
    """1.0 for an answer block that reaches `target` with `nums` (each at most once), else 0.0."""
    out = []
    for c, ns, t in zip(completions, nums, target):
        block = answer_block(c)
        out.append(1.0 if block is not None and check(block, ns, int(t))[0] else 0.0)
    return out


def format(prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:  # noqa: A001
    """1.0 for an answer block that parses, 0.5 for one that does not, 0.0 for no block."""
    out = []
    for c in completions:
        block = answer_block(c)
        if block is None:
            out.append(0.0)
            continue
        try:
            parse(block)
            out.append(1.0)
        except CountdownError:
            out.append(0.5)
    return out


# ---- the generator ------------------------------------------------------------------------------

def prompt_text(nums: Sequence[int], target: int) -> str:
    """The user turn of one problem. The worked example is another problem on purpose: with a
    literal example, "(1 + 2) * 3", the untrained SmolLM2-135M answered with a copy of it (every
    answer its first probe showed), so a group's answers tie and nothing can be learned."""
    return (f"Using the numbers {list(nums)}, write an arithmetic expression that equals {target}. "
            f"Use + - * / and parentheses, each number at most once. "
            f"Put only the expression inside {OPEN_TAG}{CLOSE_TAG}. "
            f"Example: for the numbers [2, 3, 7] and the target 13, answer {OPEN_TAG}2 * 3 + 7{CLOSE_TAG}.")


def make_problem(rng: random.Random, n_numbers: int, max_number: int = 25,
                 max_target: int = 100) -> dict[str, Any]:
    """One solvable problem: `n_numbers` numbers in 1..max_number, and a target in
    1..max_target (not one of the numbers) reached by combining 2..n of them with random
    operations whose intermediate results stay positive whole numbers (countdown's own rule);
    `solution` is that expression."""
    while True:
        nums = [rng.randint(1, max_number) for _ in range(n_numbers)]
        k = rng.randint(2, n_numbers)
        pool = [(Fraction(nums[i]), str(nums[i])) for i in rng.sample(range(n_numbers), k)]
        while len(pool) > 1:
            (a, sa), (b, sb) = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
            op = rng.choice("+-*/")
            if op == "-" and a <= b or op == "/" and (a % b != 0):
                a, sa, b, sb = b, sb, a, sa            # try the other order
            if op == "-" and a <= b or op == "/" and (a % b != 0):
                op = "+"
            v = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
            pool.append((v, f"({sa} {op} {sb})"))
        value, expr = pool[0]
        if value.denominator == 1 and 1 <= value <= max_target and int(value) not in nums:
            solution = expr[1:-1]
            return {"prompt": prompt_text(nums, int(value)), "nums": nums, "target": int(value),
                    "solution": solution}


def generate(n: int, seed: int, numbers: Sequence[int] = (3, 4), exclude: set | None = None,
             id_prefix: str = "countdown", **kw: Any) -> list[dict[str, Any]]:
    """`n` distinct problems from `seed` (the same rows on every machine: Python's Mersenne
    Twister with an integer seed is stable across versions); the count of numbers cycles
    through `numbers`; problems whose (sorted numbers, target) is in `exclude` are skipped."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        row = make_problem(rng, numbers[len(rows) % len(numbers)], **kw)
        key = (tuple(sorted(row["nums"])), row["target"])
        if key in seen:
            continue
        seen.add(key)
        rows.append({"id": f"{id_prefix}/{seed}/{len(rows)}", **row})
    return rows


def problem_key(row: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    return tuple(sorted(row["nums"])), int(row["target"])


def variant_files(variant: str = "countdown", out_dir: str | Path = HERE) -> tuple[Path, Path]:
    """(train file, probe file) of a packaged variant."""
    if variant not in VARIANTS:
        raise ValueError(f"countdown variant {variant!r}: known variants are {', '.join(VARIANTS)}")
    return Path(out_dir) / f"{variant}_train.jsonl", Path(out_dir) / f"{variant}_probe.jsonl"


def write_dataset(out_dir: str | Path = HERE, train_rows: int = 1000, probe_rows: int = 100,
                  variant: str = "countdown") -> tuple[Path, Path]:
    """The packaged train and probe files of `variant`: the probe comes from another seed and
    shares no (numbers, target) problem with the train rows."""
    paths = variant_files(variant, out_dir)
    kw = VARIANTS[variant]
    train = generate(train_rows, seed=0, id_prefix=variant, **kw)
    probe = generate(probe_rows, seed=1, exclude={problem_key(r) for r in train}, id_prefix=variant, **kw)
    for path, rows in zip(paths, (train, probe)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


if __name__ == "__main__":
    import sys
    for v in VARIANTS:
        for p in write_dataset(sys.argv[1] if len(sys.argv) > 1 else HERE, variant=v):
            print(p)
