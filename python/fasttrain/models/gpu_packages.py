"""The optional GPU packages of `pip install fasttrain[gpu]`: flash-attn 2 and Liger-Kernel.

What it is: the choice of the policy's attention implementation (flash-attn 2 on CUDA when it is
installed, PyTorch SDPA otherwise) and `policy.liger = true`, which binds Liger-Kernel's Triton
RMSNorm, SwiGLU and RoPE to a Llama-family policy. Both are other projects' kernels, used as
they ship; fasttrain adds only the check that they give the plain model's logits on the device
at hand (`check_against_plain`, run by `fasttrain selftest --device cuda`), because a wrong
kernel must never train silently.

What it is not: the rollout's decode loop (rollout/decoder.py) runs its own attention through
PyTorch's scaled_dot_product_attention over a static cache, which picks its own fused CUDA
kernels; flash-attn 2 applies to the training forwards, which go through the model's own
attention. Neither package runs on a CPU (Liger's Triton kernels do not run under
TRITON_INTERPRET on a CPU), so on a CPU both are off and asking for them is an error.

Not run on a GPU yet: no GPU has been lent to this project so far.
"""
from __future__ import annotations

import copy
import importlib
import importlib.util

import torch

__all__ = ["GpuPackageError", "attention_implementation", "set_attention", "apply_liger", "installed",
           "check_against_plain", "LIGER_FAMILIES"]

# model_type -> the Liger function that patches that family (rope, rms_norm, swiglu; no loss).
LIGER_FAMILIES = {"llama": "apply_liger_kernel_to_llama", "mistral": "apply_liger_kernel_to_mistral",
                  "qwen2": "apply_liger_kernel_to_qwen2", "qwen3": "apply_liger_kernel_to_qwen3"}
ATTENTION_CHOICES = ("auto", "sdpa", "eager", "flash_attention_2")


class GpuPackageError(ValueError):
    """A GPU package was asked for where it cannot run or is not installed."""


def installed(package: str) -> bool:
    """Whether `flash_attn` or `liger_kernel` can be imported (without importing it)."""
    return importlib.util.find_spec(package) is not None


def attention_implementation(setting: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """The attention implementation the training forwards use. `auto`: flash-attn 2 on CUDA in
    bf16/fp16 when installed (it has no fp32 or CPU kernels), otherwise None: the model keeps the
    implementation it was loaded with (Hugging Face's default is PyTorch SDPA)."""
    if setting not in ATTENTION_CHOICES:
        raise GpuPackageError(f"policy.attention: {setting!r} is not allowed; allowed: "
                              + ", ".join(ATTENTION_CHOICES))
    fa_possible = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    if setting == "auto":
        return "flash_attention_2" if fa_possible and installed("flash_attn") else None
    if setting == "flash_attention_2":
        if not fa_possible:
            raise GpuPackageError("policy.attention = 'flash_attention_2' needs a CUDA device and "
                                  f"policy.dtype bfloat16 or float16 (here: {device.type}, {dtype}); "
                                  "use 'sdpa'")
        if not installed("flash_attn"):
            raise GpuPackageError("policy.attention = 'flash_attention_2': flash-attn is not installed; "
                                  "pip install 'fasttrain[gpu]', or use 'sdpa'")
    return setting


def set_attention(model: torch.nn.Module, implementation: str) -> None:
    """Switch a loaded Hugging Face model to `implementation` (its own setter checks support)."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == implementation:
        return
    model.set_attn_implementation(implementation)


def apply_liger(model: torch.nn.Module, device: torch.device) -> None:
    """Bind Liger-Kernel's RMSNorm, SwiGLU and RoPE to `model` (its loss kernels stay off:
    fasttrain's fused_logprob is the head). The MLP patch calls the model's own projection
    modules, so NF4 layers and LoRA/DoRA adapters swapped in before or after are used as they are.
    Liger's RoPE patch replaces the family's module-level rotary function for the process."""
    if device.type != "cuda":
        raise GpuPackageError("policy.liger = true needs a CUDA device (Liger-Kernel's Triton kernels "
                              f"do not run on {device.type}); set policy.liger = false")
    if not installed("liger_kernel"):
        raise GpuPackageError("policy.liger = true: liger-kernel is not installed; "
                              "pip install 'fasttrain[gpu]', or set policy.liger = false")
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in LIGER_FAMILIES:
        raise GpuPackageError(f"policy.liger = true: model type {family!r} is not supported; "
                              f"supported: {', '.join(LIGER_FAMILIES)}")
    liger = importlib.import_module("liger_kernel.transformers")
    getattr(liger, LIGER_FAMILIES[family])(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                           fused_linear_cross_entropy=False, model=model)


# ---- the check run by `fasttrain selftest --device cuda` -----------------------------------------
def _check_inputs(vocab: int, device: torch.device):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (3, 37), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0                      # a left-padded row, as the trainer's batches have
    mask[2, :30] = 0
    return ids.to(device), mask.to(device)


def _logits(model, ids, mask) -> torch.Tensor:
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.double()


def check_against_plain(package: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Logits of a small random Llama in `dtype` with `package` ("flash_attn" or "liger_kernel")
    against the same model in float64. Passes when its error is at most twice that of the plain
    model in `dtype` (PyTorch SDPA, no package) plus one unit roundoff of the logits' scale: the
    rule that a fused kernel may not be less exact than the framework's own low-precision path.
    Returns {"passed", "max_err", "tol", "plain_err"}; only real (non-pad) positions count."""
    from fasttrain.models.tiny import tiny_llama

    vocab = 512
    ref = tiny_llama(vocab_size=vocab, hidden=256, layers=2, heads=4, kv_heads=2, seed=3,
                     dtype=torch.float64).to(device)
    ref.set_attn_implementation("sdpa")    # eager attention turns left-padded rows into NaN in float64
    ids, mask = _check_inputs(vocab, device)
    want = _logits(ref, ids, mask)
    plain = copy.deepcopy(ref).to(dtype)
    plain.set_attn_implementation("sdpa")
    plain_out = _logits(plain, ids, mask)       # before Liger's RoPE patch changes the family's function
    fast = copy.deepcopy(ref).to(dtype)
    if package == "flash_attn":
        fast.set_attn_implementation("flash_attention_2")
    elif package == "liger_kernel":
        fast.set_attn_implementation("sdpa")
        apply_liger(fast, device)
    else:
        raise ValueError(f"check_against_plain: unknown package {package!r}")
    got = _logits(fast, ids, mask)
    real = mask.bool()
    plain_err = float((plain_out - want).abs()[real].max())
    err = float((got - want).abs()[real].max())
    u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    tol = 2.0 * plain_err + u * float(want.abs()[real].max())
    return {"passed": bool(err <= tol), "max_err": err, "tol": tol, "plain_err": plain_err}
