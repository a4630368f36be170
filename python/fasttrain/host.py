"""Facts about the host this process runs on, read where Linux publishes them, and fasttrain's one
cache folder on it.

The CPU facts: `cpu_name()` (the model name /proc/cpuinfo gives), `cpu_bf16_compute()` (whether
the compiled CPU kernels compute bf16 inputs in bf16: the extension's own answer). The cache:
`cache_root()`, where the host's measured rates, the selftest's verdicts and the bundled model's
files are kept: $FASTTRAIN_CACHE, else $XDG_CACHE_HOME/fasttrain, else ~/.cache/fasttrain. The
variable FASTTRAIN_CACHE_DIR, which named the verdicts' and rates' folder before the two folders
became one, is still read when FASTTRAIN_CACHE is not set, with a warning the first time.
"""
from __future__ import annotations

import os
import platform
import warnings
from pathlib import Path

__all__ = ["meminfo_bytes", "cpu_name", "cpu_bf16_compute", "cache_root", "CACHE_VAR", "OLD_CACHE_VAR"]

CACHE_VAR = "FASTTRAIN_CACHE"
OLD_CACHE_VAR = "FASTTRAIN_CACHE_DIR"       # read when CACHE_VAR is unset, with a warning once
_warned_old_var = False


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


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says, else "cpu"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def cpu_bf16_compute() -> bool:
    """Whether the compiled CPU kernels compute bf16 inputs in bf16 (native bf16 GEMMs:
    avx512_bf16 or AMX, with ATen dispatching at AVX512 or above), else in fp32: the extension's
    own answer (fasttrain._C.cpu_has_bf16)."""
    from fasttrain._native import load
    return bool(load().cpu_has_bf16())


def cache_root() -> Path:
    """fasttrain's cache folder: $FASTTRAIN_CACHE, else $XDG_CACHE_HOME/fasttrain, else
    ~/.cache/fasttrain (the old $FASTTRAIN_CACHE_DIR is read when $FASTTRAIN_CACHE is unset)."""
    global _warned_old_var
    env = os.environ.get(CACHE_VAR)
    if env:
        return Path(env).expanduser()
    old = os.environ.get(OLD_CACHE_VAR)
    if old:
        if not _warned_old_var:
            _warned_old_var = True
            warnings.warn(f"{OLD_CACHE_VAR} is read for this release only: set {CACHE_VAR}={old} instead "
                          f"(one cache folder for the measured rates, the selftest's verdicts and the models)",
                          FutureWarning, stacklevel=2)
        return Path(old).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fasttrain"
