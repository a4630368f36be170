"""The starter task's rows: "What is A plus B?" with the `answer` column, generated from a seed.

What this file is: the generator of `data.jsonl` beside it (a pure function of the seed, the
same rows on every machine; `python -m fasttrain.tasks.starter.arithmetic` writes the file again and a
test checks the packaged file equals its output). What it is not: part of the starter folder
`fasttrain init` writes (that folder holds the rows, not their generator).

Sizes: 300 rows, the last 100 held out (the recipe's env.probe_rows): "A plus B" and "A minus B"
with A in 1..20 and B in 1..9 (a difference is never negative; 324 distinct questions exist). The bundled SmolLM2-135M-Instruct
starts between 10% and 50% correct on them (bench/learning_eval.py measures it; the number is in
the recipe's header). Measured on bands of 40 questions (bf16, temperature 0.7, 16 new tokens,
"Answer with the number only."): one-digit sums 33%, two-digit plus one-digit 10%, differences
under 20 25%, one-digit products 0%. Most wrong answers are not wrong sums but explanations
("To find 5 + 6, you start by ...") cut off at 16 tokens, which is what RL on `correct` and
`concise` teaches away; products are left out (nothing to reinforce at 0%).
On the 100 held-out rows, 2 answers each (bench/learning_eval.py, bf16 base, seed 1234): with A in
1..30, 10.5% correct (one-digit A 25%, larger A 5%); with A in 1..20, 10.0%; with A in 1..20 and
the question ending in "Answer with just the number." (these rows), 16.0%; written as "A + B =",
11.0%. A 2-core CPU shared with other work, 2026-12-01 (a score does not depend on the load).
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = ["generate", "write_data", "DATA_FILE", "ROWS"]

DATA_FILE = Path(__file__).parent / "data.jsonl"
ROWS = 300
ASK = "Answer with just the number."


def _row(rng: random.Random) -> dict[str, Any]:
    a, b = rng.randint(1, 20), rng.randint(1, 9)
    if rng.random() < 0.5:
        return {"prompt": f"What is {a} plus {b}? {ASK}", "answer": a + b}
    a, b = max(a, b), min(a, b)
    return {"prompt": f"What is {a} minus {b}? {ASK}", "answer": a - b}


def generate(n: int = ROWS, seed: int = 0) -> list[dict[str, Any]]:
    """`n` distinct questions (a question never repeats, so the held-out rows are unseen)."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        r = _row(rng)
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            rows.append(r)
    return rows


def write_data(path: str | Path = DATA_FILE, n: int = ROWS, seed: int = 0) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in generate(n, seed)))
    return path


if __name__ == "__main__":
    import sys
    print(write_data(sys.argv[1] if len(sys.argv) > 1 else DATA_FILE))
