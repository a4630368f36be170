"""The selftest's verdict cache, read by `fasttrain info` and the trainer: one verdict per (device
kind, device name, build of the compiled extension)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from fasttrain.selftest.device import cpu_name

__all__ = ["cache_dir", "build_id", "verdict_path", "record_verdict", "read_verdict", "verdict_line"]


def cache_dir() -> Path:
    """fasttrain's one cache folder (fasttrain.host.cache_root)."""
    from fasttrain.host import cache_root
    return cache_root()


def build_id() -> str:
    """The compiled extension's identity: version, torch, CUDA archs, the CPU variant that runs, and
    the library files' sizes and modification times (a rebuild is a new build)."""
    from fasttrain import _native
    from fasttrain.ops import build_info
    _native.load()
    bi = build_info()
    text = f"{bi['version']}|{bi['torch_version']}|{bi['cuda_archs']}|{bi['cpu_variant']}"
    for so in _native.library_files():
        st = so.stat()
        text += f"|{so.name}|{st.st_size}|{int(st.st_mtime)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def verdict_path() -> Path:
    return cache_dir() / "selftest_verdicts.json"


def _verdict_key(info: dict[str, Any]) -> str:
    return f"{info['device'].split(':')[0]}|{info['name']}|{build_id()}"


def record_verdict(report: dict[str, Any]) -> Path | None:
    """Keep this report's verdict under (device kind, device name, build). Returns the file, or None
    when the cache cannot be written (read-only home): the verdict is then only in the report."""
    path = verdict_path()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    data[_verdict_key(report["device"])] = {
        "passed": report["passed"], "quick": report["quick"], "when": report["started"], "cases": report["cases"],
        "failing": [f"{r['op']} [{r['case']}]" for r in report["failing"]]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
        return path
    except OSError:
        return None


def read_verdict(device: str | torch.device) -> dict[str, Any] | None:
    """The last recorded verdict for this device and this build, or None."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    try:
        data = json.loads(verdict_path().read_text())
    except (OSError, ValueError):
        return None
    return data.get(f"{dev.type}|{name}|{build_id()}")


def verdict_line(device: str | torch.device) -> str:
    """One line for `fasttrain info`: were the compiled kernels verified on this device, and when."""
    dev = torch.device(device)
    try:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
        v = read_verdict(dev)
    except Exception as e:  # no extension, no driver: say so rather than fail `info`
        return f"kernels on {dev.type}: not verified ({type(e).__name__}: {e})"
    if v is None:
        return (f"kernels on {dev.type} ({name}): not verified for this build; run `fasttrain selftest "
                f"--device {dev.type}`")
    how = "selftest --quick" if v["quick"] else "selftest"
    if v["passed"]:
        return f"kernels on {dev.type} ({name}): verified by {how} at {v['when']} ({v['cases']} cases passed)"
    return (f"kernels on {dev.type} ({name}): FAILED {how} at {v['when']}: {', '.join(v['failing'][:4])}"
            f"{' ...' if len(v['failing']) > 4 else ''}; use run.kernels = \"reference\"")

