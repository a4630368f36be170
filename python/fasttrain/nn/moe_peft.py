"""LoRA on routed experts in PEFT's `target_parameters` format, so PEFT (0.21) loads what fasttrain saves.

PEFT wraps each targeted 3-D parameter in a ParamWrapper, the later target outside the earlier one;
with target_parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] (the order written
here) the saved keys of a layer's experts are, without the parameter's name:
  <path>.experts.base_layer.lora_A.weight   [r·E, H]    gate_up_proj's A
  <path>.experts.base_layer.lora_B.weight   [2I, r·E]   gate_up_proj's B
  <path>.experts.lora_A.weight              [r·E, I]    down_proj's A
  <path>.experts.lora_B.weight              [H, r·E]    down_proj's B
lora_A is expert-major (rows e·r .. e·r + r - 1 are expert e's A_e [r, in]); lora_B is laid out
(out, r, E), so expert e's B_e [out, r] is the columns e, e + E, e + 2E, ...: B[:, e::E]. fasttrain
keeps A [E, r, in] and B [E, out, r]; the two functions below convert, exactly (a reshape and a
permutation of fp32 values).
"""
from __future__ import annotations

import torch
from torch import nn

from fasttrain.nn.moe_experts import moe_expert_layers

__all__ = ["TARGET_PARAMETERS", "moe_adapter_tensors", "load_moe_adapter_tensors", "moe_adapter_kind"]

TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
_KEYS = {"gate_up": "base_layer.", "down": ""}          # where each stack's factors sit under `experts.`


def to_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fasttrain's A [E, r, in], B [E, out, r] -> PEFT's lora_A [r·E, in], lora_B [out, r·E]."""
    E, r, k = a.shape
    return a.reshape(E * r, k), b.permute(1, 2, 0).reshape(b.shape[1], r * E)


def from_peft(a: torch.Tensor, b: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's lora_A [r·E, in], lora_B [out, r·E] -> fasttrain's A [E, r, in], B [E, out, r]."""
    r = a.shape[0] // E
    return a.reshape(E, r, a.shape[1]), b.reshape(b.shape[0], r, E).permute(2, 0, 1)


def moe_adapter_kind(model: nn.Module) -> set[tuple]:
    """{(kind, r, alpha, rslora)} of the model's expert adapters (empty without any)."""
    return {(m.adapter, m.r, m.alpha, m.rslora) for _, m in moe_expert_layers(model) if m.adapter is not None}


def moe_adapter_tensors(model: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """PEFT's saved tensors of every expert adapter (fp32, CPU), keys under `prefix`."""
    out = {}
    for name, m in moe_expert_layers(model):
        if m.adapter is None:
            continue
        for stack, key in _KEYS.items():
            a, b = to_peft(getattr(m, f"{stack}_lora_A").detach(), getattr(m, f"{stack}_lora_B").detach())
            out[f"{prefix}{name}.{key}lora_A.weight"] = a.float().contiguous().cpu()
            out[f"{prefix}{name}.{key}lora_B.weight"] = b.float().contiguous().cpu()
    return out


def load_moe_adapter_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], prefix: str, r: int, alpha: float,
                             rslora: bool) -> tuple[list[nn.Parameter], set[str]]:
    """Attach the expert adapters found in `tensors` (PEFT keys under `prefix`); returns their
    parameters and the keys used."""
    params, used = [], set()
    for name, m in moe_expert_layers(model):
        keys = {s: (f"{prefix}{name}.{k}lora_A.weight", f"{prefix}{name}.{k}lora_B.weight") for s, k in _KEYS.items()}
        if keys["down"][0] not in tensors:
            continue
        params += m.attach_adapter("lora", r, alpha, rslora)
        with torch.no_grad():
            for stack, (ka, kb) in keys.items():
                a, b = from_peft(tensors[ka], tensors[kb], m.num_experts)
                getattr(m, f"{stack}_lora_A").copy_(a)
                getattr(m, f"{stack}_lora_B").copy_(b)
                used.update((ka, kb))
    return params, used
