"""The starter's packaged rows are the generator's output, unique, and their answers right."""
import json

from fasttrain.tasks.starter import arithmetic


def test_starter_rows_are_the_generators_output(tmp_path):
    made = arithmetic.write_data(tmp_path / "data.jsonl")
    assert made.read_bytes() == arithmetic.DATA_FILE.read_bytes()


def test_starter_rows_are_distinct_and_correct():
    rows = [json.loads(line) for line in arithmetic.DATA_FILE.read_text().splitlines()]
    assert len(rows) == arithmetic.ROWS == 300 and len({r["prompt"] for r in rows}) == 300
    for r in rows:
        question, ask = r["prompt"].split("? ")
        assert ask == arithmetic.ASK
        _, _, a, op, b = question.split()
        a, b = int(a), int(b)
        assert r["answer"] == (a + b if op == "plus" else a - b) and r["answer"] >= 0, r
