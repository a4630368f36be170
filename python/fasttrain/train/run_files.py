"""The files of a run folder, written atomically (temp file + os.replace), and run ids."""
from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

from fasttrain.safe_json import json_safe

__all__ = ["write_text", "write_json", "read_jsonl", "CorruptRunFile", "append_jsonl", "truncate_jsonl", "new_run_id",
           "json_safe"]


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(json_safe(obj), indent=1) + "\n")


def append_jsonl(path: str | Path, row: dict[str, Any]) -> None:
    """One line per call, flushed; a torn last line (crash mid-write) is dropped by read_jsonl."""
    with open(path, "a") as f:
        f.write(json.dumps(json_safe(row)) + "\n")
        f.flush()


class CorruptRunFile(ValueError):
    """A line of a run's JSONL file is not JSON; the message names the file and the line."""


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL run file. A line that is not JSON raises CorruptRunFile naming the file
    and the line; the one exception is an unterminated last line (a crash in the middle of
    append_jsonl), which is dropped with a warning that names it."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines):            # no newline after it: the write was interrupted
                warnings.warn(f"{path}: line {n} was cut short by an interrupted write; dropping it",
                              stacklevel=2)
                break
            raise CorruptRunFile(f"{path}: line {n} is not JSON ({e.msg}): {line[:80]!r}. Fix or delete "
                                 "that line (a run folder's JSONL files are one JSON object per line).") from e
    return rows


def truncate_jsonl(path: str | Path, keep: Iterable[dict[str, Any]]) -> None:
    write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def new_run_id(name: str, config_hash: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{config_hash}"
