"""Model surgery for Hugging Face causal LMs (Llama, Qwen2, Qwen3, Mistral, ...): swap the projection
nn.Linear layers for NF4Linear (`quantize_model`) or for DenseLinear, the same 16-bit weight made
adaptable (`adaptable_model`), attach LoRA/DoRA adapters, switch adapters off for the reference
policy, merge back to a plain bf16 model, and report resident bytes per layer. Projections are
found by the last part of their module name, so any nn.Linear of any family can be a target.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from fasttrain.nn.adapted_linear import adapted_layers
from fasttrain.nn.dense_linear import DenseLinear
from fasttrain.nn.moe_experts import moe_expert_layers
from fasttrain.nn.nf4_linear import NF4Linear

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def nf4_layers(model: nn.Module) -> Iterator[tuple[str, NF4Linear]]:
    """(qualified name, layer) for every NF4Linear in the model, in module order."""
    for name, mod in model.named_modules():
        if isinstance(mod, NF4Linear):
            yield name, mod


def _swap_linears(model: nn.Module, targets: tuple[str, ...], make, caller: str) -> nn.Module:
    """Replace every nn.Linear whose last name part is in `targets` by `make(linear)` (in place) and
    freeze the whole model, since only adapters train. Raises if no layer matches (a wrong target
    list is a bug)."""
    targets = tuple(targets)
    found = [(n, m) for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and n.rpartition(".")[2] in targets]
    if not found:
        raise ValueError(f"{caller}: no nn.Linear named any of {targets} in {type(model).__name__}")
    for name, lin in found:
        set_module(model, name, make(lin))
        del lin
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def quantize_model(model: nn.Module, targets: tuple[str, ...] = PROJECTIONS, blocksize: int = 64,
                   double_quant: bool = False) -> nn.Module:
    """Replace every nn.Linear whose last name part is in `targets` by a frozen NF4Linear (in place).
    The rest of the model (embeddings, norms, lm_head) is left as it is and frozen. Returns the model."""
    return _swap_linears(model, targets, lambda lin: NF4Linear.from_linear(lin, blocksize=blocksize,
                                                                           double_quant=double_quant),
                         "quantize_model")


def adaptable_model(model: nn.Module, targets: tuple[str, ...] = PROJECTIONS) -> nn.Module:
    """Replace every nn.Linear whose last name part is in `targets` by a DenseLinear holding the same
    16-bit weight (no copy; `policy.quantize = "none"`), in place; the model is frozen. Returns it."""
    return _swap_linears(model, targets, DenseLinear.from_linear, "adaptable_model")


def attach_adapters(model: nn.Module, kind: str = "lora", r: int = 32, alpha: float = 64, rslora: bool = False,
                    targets: tuple[str, ...] | None = None, seed: int | None = None) -> list[nn.Parameter]:
    """Attach a fresh LoRA/DoRA adapter to each adaptable layer, NF4Linear or DenseLinear (or those
    whose last name part is in `targets`). Returns the trainable parameters (fp32), in module order."""
    gen = None
    if seed is not None:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
    params: list[nn.Parameter] = []
    layers = [(n, m) for n, m in list(adapted_layers(model)) + moe_expert_layers(model)
              if targets is None or n.rpartition(".")[2] in tuple(targets)]
    if not layers:
        raise ValueError("attach_adapters: the model has no matching NF4Linear or DenseLinear layers "
                         "(call quantize_model or adaptable_model first)")
    for _, layer in layers:
        if gen is not None and layer.device.type != "cpu":
            p = layer.attach_adapter(kind, r, alpha, rslora)  # generators are per-device; seed the global one
        else:
            p = layer.attach_adapter(kind, r, alpha, rslora, generator=gen)
        params += p
    return params


@contextmanager
def adapters_disabled(model: nn.Module):
    """Inside the block every adapted layer runs its base only: the reference policy, with no copy."""
    layers = [m for _, m in list(adapted_layers(model)) + moe_expert_layers(model)]
    before = [m.adapters_enabled for m in layers]
    for m in layers:
        m.adapters_enabled = False
    try:
        yield model
    finally:
        for m, b in zip(layers, before):
            m.adapters_enabled = b


def merge_adapters(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace every adapted layer (NF4Linear, DenseLinear) by a plain nn.Linear holding the merged
    weight in `dtype` (in place): W + s·B·A for LoRA, m/‖W + s·B·A‖ ⊙ (W + s·B·A) for DoRA. The
    result saves with save_pretrained."""
    for name, layer in list(adapted_layers(model)):
        lin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                        device=layer.device, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(layer.merged_weight(dtype))
            if layer.bias is not None:
                lin.bias.copy_(layer.bias.to(dtype))
        lin.requires_grad_(False)
        set_module(model, name, lin)
    return model


def resident_bytes(model: nn.Module) -> dict:
    """Bytes held per adapted layer: {name: {"base": packed weights + scales (NF4) or the 16-bit weight
    (DenseLinear), + bias, "adapter": LoRA/DoRA parameters (+ the ‖W‖² buffer), "weights": out*in,
    "bits_per_weight": 8*base/weights}}, plus "total" (all layers, their bits per weight, and
    "other": every other tensor)."""
    out: dict = {}
    seen: set[int] = set()
    counted: set[int] = set()  # storages shared between layers (the double-quant code) count once

    def once(t: torch.Tensor) -> int:
        key = t.untyped_storage().data_ptr()
        if key in counted:
            return 0
        counted.add(key)
        return t.numel() * t.element_size()

    base_sum = adapter_sum = weights_sum = 0
    for name, layer in adapted_layers(model):
        base = sum(once(t) for n, t in layer.named_buffers(recurse=False) if n != "weight_sq_norm" and t is not None)
        dense = layer.weight if isinstance(layer, DenseLinear) else None
        base += sum(p.numel() * p.element_size() for p in (dense, layer.bias) if p is not None)
        adapter = sum(p.numel() * p.element_size() for p in layer.adapter_parameters())
        if getattr(layer, "weight_sq_norm", None) is not None:
            adapter += layer.weight_sq_norm.numel() * layer.weight_sq_norm.element_size()
        nw = layer.in_features * layer.out_features
        out[name] = {"base": base, "adapter": adapter, "weights": nw, "bits_per_weight": 8.0 * base / nw}
        base_sum, adapter_sum, weights_sum = base_sum + base, adapter_sum + adapter, weights_sum + nw
        seen.update(id(t) for t in layer.buffers(recurse=False))
        seen.update(id(t) for t in layer.parameters(recurse=False))
    other = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
                if id(t) not in seen)
    out["total"] = {"base": base_sum, "adapter": adapter_sum, "weights": weights_sum, "other": other,
                    "bits_per_weight": 8.0 * base_sum / weights_sum if weights_sum else 0.0,
                    "all": base_sum + adapter_sum + other}
    return out
