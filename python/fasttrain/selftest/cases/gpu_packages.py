"""Selftest cases of the optional GPU packages (flash-attn 2, Liger-Kernel): the model's logits with
and without them, against float64."""
from __future__ import annotations

from typing import Callable

import torch

from fasttrain.selftest.harness import Check, timed

__all__ = ["package_case", "package_cases"]


def package_case(dev, package: str) -> tuple[str, Callable]:
    def run(check: Check):
        from fasttrain.models.gpu_packages import check_against_plain
        res, t = timed(lambda: check_against_plain(package, dev), dev)
        # error against the float64 model, tolerance twice the plain bf16 model's error (+ u·|logit|)
        check.close("logits", torch.tensor([res["max_err"]]), torch.tensor([0.0]), res["tol"])
        return t, 0.0
    return f"tiny Llama bf16 logits with {package} vs float64 (plain bf16 error x2)", run, f"gpu_packages:{package}"


def package_cases(dev, quick: bool):
    """Only on CUDA, and only for the packages installed there: those are the ones a run uses."""
    if dev.type != "cuda":
        return []
    from fasttrain.models.gpu_packages import installed
    return [package_case(dev, p) for p in ("flash_attn", "liger_kernel") if installed(p)]

