"""Standard JSON for reports that may hold non-finite floats (an infinite error, a NaN loss)."""
from __future__ import annotations

import math
from typing import Any

__all__ = ["json_safe"]


def json_safe(obj: Any) -> Any:
    """Non-finite floats become strings ("nan", "inf", "-inf") so the JSON stays standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
