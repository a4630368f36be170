"""The device a selftest ran on, as a bug report needs it."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

__all__ = ["device_info", "cpu_name", "nvidia_driver"]


def device_info(device: torch.device) -> dict[str, Any]:
    """What a bug report needs: device, driver, torch/CUDA versions, compute capability, the build."""
    from fasttrain.ops import build_info
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
                            "python": platform.python_version(), "platform": platform.platform(),
                            "cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                            "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),
                            "build": build_info()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, compute_capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count, driver=nvidia_driver())
    else:
        info.update(name=info["cpu"], compute_capability=None, driver=None)
    return info


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None

