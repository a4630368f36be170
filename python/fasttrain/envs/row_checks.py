"""Checks of a dataset's rows before a run starts: text that is not UTF-8, and rows that lack a
column a reward function asks for. Each finding names the file and the row (0-based, as the
prompt ids count them: `dataset/12` is row 12); with `env.skip_bad_rows = true` the row is left
out instead and the reason is kept for the run's report.

Not here: whether a rendered prompt fits `rollout.max_prompt_tokens` (that needs the policy's
tokenizer; the trainer checks it, fasttrain.train.prompt_length).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Sequence

from .protocol import DatasetError

__all__ = ["utf8_rows", "missing_columns", "TRL_ARGS"]

TRL_ARGS = ("prompts", "completions", "completion_ids")       # what every reward gets besides columns


def _error(msg: str):
    return DatasetError(msg)


def utf8_rows(p: Path, fmt: str, key: str, skipped: list[str] | None) -> Path:
    """`p` when every line of a text data file is UTF-8. Otherwise a DatasetError naming the first
    bad row, or (skipped is a list) a temporary copy without the bad lines, their reasons appended
    to `skipped`. Parquet stores UTF-8 by its format: returned as is."""
    if fmt not in ("json", "csv"):
        return p
    raw = p.read_bytes()
    try:
        raw.decode("utf-8")
        return p
    except UnicodeDecodeError:
        pass
    keep, row = [], 0
    header = fmt == "csv"
    for n, line in enumerate(raw.splitlines(keepends=True), 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            where = "the header line" if header else f"row {row} (line {n})"
            why = f"{key}: {str(p)!r} {where} is not UTF-8 text (byte {e.start} of the line is {line[e.start]:#04x})"
            if skipped is None or header:
                raise _error(f"{why}. Re-save the file as UTF-8, or set env.skip_bad_rows = true to leave "
                             "such rows out") from None
            skipped.append(why)
            row += bool(line.strip())
            continue
        keep.append(line)
        if header:
            header = False
        else:
            row += bool(line.strip())
    folder = Path(tempfile.mkdtemp(prefix="fasttrain-utf8-"))
    clean = folder / p.name
    clean.write_bytes(b"".join(keep))
    return clean


def missing_columns(rows: Sequence[tuple[str, dict[str, Any]]], needs: dict[str, list[str]], columns: Sequence[str],
                    where: str, skipped: list[str] | None) -> set[str]:
    """The ids of rows (given as (id, fields)) that lack a value for a column a reward needs.
    `needs`: reward name -> its parameters without a default (TRL's own arguments left out). A
    column no row has is always an error; a row without it is one too unless skipped is a list."""
    for name, params in needs.items():
        absent = [c for c in params if c not in columns]
        if absent:
            raise _error(f"env.rewards: reward {name!r} takes the argument(s) {absent}, but {where} has no such "
                         f"column (its columns: {', '.join(columns) or 'none besides prompt'}). Add the column, "
                         f"or give the argument a default")
    bad = set()
    for pid, fields in rows:
        for name, params in needs.items():
            lack = [c for c in params if fields.get(c) is None]
            if lack:
                why = f"{where} row {pid.rsplit('/', 1)[-1]}: no value in column {lack[0]!r}, which reward {name!r} needs"
                if skipped is None:
                    raise _error(f"{why}. Fill it in, or set env.skip_bad_rows = true to leave such rows out")
                skipped.append(why)
                bad.add(pid)
                break
    return bad
