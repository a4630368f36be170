"""The files of a run folder, written atomically (temp file + os.replace), and run ids."""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

__all__ = ["write_text", "write_json", "read_jsonl", "append_jsonl", "truncate_jsonl", "new_run_id",
           "json_safe"]


def json_safe(obj: Any) -> Any:
    """Non-finite floats become strings ("nan", "inf", "-inf") so the JSON stays standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


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


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def truncate_jsonl(path: str | Path, keep: Iterable[dict[str, Any]]) -> None:
    write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def new_run_id(name: str, config_hash: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{config_hash}"
