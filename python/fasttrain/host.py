"""Facts about the host this process runs on, read where Linux publishes them."""
from __future__ import annotations

__all__ = ["meminfo_bytes"]


def meminfo_bytes(field: str) -> int:
    """A /proc/meminfo field in bytes ("MemTotal", "MemAvailable", ...); 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
