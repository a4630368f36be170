"""The accelerators `fasttrain plan` knows: memory, dense bf16 tensor-core peak, memory bandwidth.

Numbers are the vendors' datasheet values (dense, i.e. without 2:4 sparsity):
  NVIDIA H100 Tensor Core GPU datasheet (SXM5 80 GB: 989 TFLOP/s bf16, 3.35 TB/s HBM3),
  NVIDIA H200 Tensor Core GPU datasheet (SXM 141 GB: 989 TFLOP/s bf16, 4.8 TB/s HBM3e),
  NVIDIA A100 Tensor Core GPU datasheet (SXM 80 GB: 312 TFLOP/s bf16, 2,039 GB/s HBM2e),
  NVIDIA L40S datasheet (48 GB GDDR6: 362 TFLOP/s bf16 dense (733 with sparsity), 864 GB/s).
Memory is the datasheet capacity in GB (10^9 bytes); the driver and the CUDA context take part of it,
which the plan counts separately. The `cpu` entry is this host: its memory is read from /proc/meminfo
and its table rates are order-of-magnitude values for a 2-core server slice; `measured` replaces
them by the rates measured on this host's CPU, or on its CUDA card (fasttrain.plan.host_rates), which
`fasttrain plan` then times every phase with.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["GPU", "GPUS", "gpu_spec", "gpu_for_device", "measured"]


@dataclass(frozen=True)
class GPU:
    name: str                 # the key users pass: --gpu h100-sxm-80gb
    title: str
    memory_bytes: int
    bf16_flops: float         # dense tensor-core peak, FLOP/s
    bandwidth: float          # bytes/s
    source: str
    context_bytes: int = 600 * 2**20   # CUDA context + cuBLAS workspace: assumed, not allocated by torch
    rates: object = None               # fasttrain.plan.host_rates.HostRates when measured on this host


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100-sxm-80gb", "NVIDIA H100 SXM 80GB", 80 * 10**9, 989e12, 3.35e12, "NVIDIA H100 datasheet (SXM5)"),
    GPU("h200-141gb", "NVIDIA H200 141GB", 141 * 10**9, 989e12, 4.8e12, "NVIDIA H200 datasheet (SXM)"),
    GPU("a100-80gb", "NVIDIA A100 80GB", 80 * 10**9, 312e12, 2.039e12, "NVIDIA A100 datasheet (SXM4 80GB)"),
    GPU("l40s-48gb", "NVIDIA L40S 48GB", 48 * 10**9, 362e12, 0.864e12, "NVIDIA L40S datasheet"),
    GPU("cpu", "this host's CPU", 0, 0.2e12, 20e9, "host memory from /proc/meminfo; rates are order-of-magnitude",
        context_bytes=0),
)}


def _host_memory() -> int:
    from fasttrain.host import meminfo_bytes
    return meminfo_bytes("MemTotal")


def gpu_spec(name: str) -> GPU:
    """The table entry for `name` (case-insensitive); a clear error lists the known names."""
    key = str(name).strip().lower()
    if key not in GPUS:
        raise ValueError(f"--gpu {name!r} is not known; known: {', '.join(GPUS)}")
    g = GPUS[key]
    return replace(g, memory_bytes=_host_memory()) if key == "cpu" else g


def gpu_for_device(device) -> GPU:
    """The entry for a torch device the trainer runs on: the CPU, or the CUDA card by its name and
    the memory the driver reports (unknown cards keep H100 rates and say so in their title)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return gpu_spec("cpu")
    props = torch.cuda.get_device_properties(dev)
    name = props.name.lower()
    base = GPUS["h200-141gb"] if "h200" in name else GPUS["a100-80gb"] if "a100" in name else \
        GPUS["l40s-48gb"] if "l40s" in name else GPUS["h100-sxm-80gb"]
    known = any(k in name for k in ("h100", "h200", "a100", "l40s"))
    title = props.name if known else f"{props.name} (rates assumed: {base.title})"
    return replace(base, name=base.name if known else "cuda", title=title, memory_bytes=int(props.total_memory))


def measured(g: GPU, device: str, rates=None) -> GPU:
    """`g` (this host's CPU, or the card gpu_for_device found) with the rates measured on `device`
    ("cpu" or "cuda"): `rates` when given (fasttrain.train.calibrate's, which the CLI runs on
    demand), else those cached (fasttrain.plan.host_rates); `g` unchanged when there are none.
    The plan never measures: it reads what the calibration stored."""
    from fasttrain.plan.host_rates import cached_rates
    r = rates if rates is not None else cached_rates(device)
    if r is None:
        return g
    return replace(g, bf16_flops=r.matmul_bf16, bandwidth=r.bandwidth, rates=r,
                   source=f"rates measured on {r.device}, {r.threads} thread(s), {r.measured_at}")
