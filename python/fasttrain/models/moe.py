"""The mixture-of-experts families' piece of model building: transformers' sparse MoE blocks
(Qwen3-MoE, Qwen3.5-MoE) become fasttrain.nn.MoEBlock, their fused expert stacks NF4 per expert
(`policy.quantize = "nf4"`) or kept 16-bit, the router and the shared-expert gate 16-bit.

    moe_surgery(model, nf4=True)          # in place; returns the model

Routing follows the family: softmax over the E router logits, top-k, renormalised to sum 1 for
Qwen3.5-MoE always and for Qwen3-MoE when config.norm_topk_prob. Qwen3-MoE's dense layers (those in
mlp_only_layers, or off the decoder_sparse_step) keep their dense MLP, which the usual surgery
quantizes and adapts like any other projection.

What it is not: a loader (models/loading.py reads the checkpoint); a model implementation (the
attention and Gated DeltaNet layers are transformers' modules, driven by fasttrain's decoders).
"""
from __future__ import annotations

import torch
from torch import nn

from fasttrain.models.families import family_of
from fasttrain.nn.moe_experts import MoEBlock, MoEExperts, moe_blocks
from fasttrain.ops.moe_experts import ExpertStack

__all__ = ["moe_surgery", "is_moe", "renormalizes", "hf_sparse_blocks", "train_router", "moe_layers"]


def is_moe(model) -> bool:
    """Whether `model` belongs to a mixture-of-experts family."""
    try:
        return family_of(model).moe
    except ValueError:
        return False


def renormalizes(model) -> bool:
    """Whether the family renormalises the top-k routing weights (Qwen3.5-MoE always, Qwen3-MoE when
    config.norm_topk_prob)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return family_renormalizes(family_of(model), model.config)


def family_renormalizes(family, config) -> bool:
    """renormalizes() from a family and a (text) config."""
    return family.renormalize_topk or bool(getattr(config, "norm_topk_prob", False))


def hf_sparse_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of every transformers sparse MoE block: a router `gate` with a [E, H] weight and
    `experts` holding the fused gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    out = []
    for name, mod in model.named_modules():
        ex = getattr(mod, "experts", None)
        if isinstance(mod, MoEBlock) or ex is None or not hasattr(ex, "gate_up_proj"):
            continue
        out.append((name, mod))
    return out


def _stack(w: torch.Tensor, nf4: bool, blocksize: int, double_quant: bool) -> ExpertStack:
    if nf4:
        return ExpertStack.quantize(w.detach(), blocksize=blocksize, double_quant=double_quant)
    E, out_f, in_f = w.shape
    return ExpertStack(E, out_f, in_f, w.dtype, weight=w.detach())


def moe_block(hf_block: nn.Module, top_k: int, renormalize: bool, nf4: bool, blocksize: int = 64,
              double_quant: bool = False) -> MoEBlock:
    """A MoEBlock holding `hf_block`'s router, experts (NF4 per expert or 16-bit) and shared expert."""
    ex = hf_block.experts
    if getattr(ex, "is_transposed", False):
        raise ValueError(f"{type(ex).__name__}: transposed expert stacks ([E, in, out]) are not a layout "
                         "fasttrain reads; qwen3_moe and qwen3_5_moe store [E, out, in]")
    experts = MoEExperts(_stack(ex.gate_up_proj, nf4, blocksize, double_quant),
                         _stack(ex.down_proj, nf4, blocksize, double_quant))
    return MoEBlock(hf_block.gate.weight, experts, top_k, renormalize,
                    getattr(hf_block, "shared_expert", None), getattr(hf_block, "shared_expert_gate", None))


def moe_surgery(model: nn.Module, nf4: bool, blocksize: int = 64, double_quant: bool = False) -> nn.Module:
    """Replace every transformers sparse MoE block of `model` by a MoEBlock (in place; see the module
    header). The model is frozen afterwards. A model without such blocks (a dense model) is returned
    unchanged."""
    from fasttrain.nn.surgery import set_module
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    blocks = hf_sparse_blocks(base)
    if not blocks:
        return model
    renorm = renormalizes(base)
    top_k = int(base.config.num_experts_per_tok)
    for name, block in blocks:
        set_module(base, name, moe_block(block, top_k, renorm, nf4, blocksize, double_quant))
        del block
    for p in base.parameters():
        p.requires_grad_(False)
    return model


def moe_layers(model: nn.Module) -> list[int]:
    """The decoder-layer indices whose MLP is a MoEBlock, in order."""
    out = []
    for name, _ in moe_blocks(model):
        parts = name.split(".")
        out.append(int(parts[parts.index("layers") + 1]))
    return out


def train_router(model: nn.Module, on: bool) -> list[nn.Parameter]:
    """moe.train_router: each MoE block's router weight as an fp32 trainable master (returned), or
    nothing (frozen, the default)."""
    if not on:
        return []
    out = []
    for _, block in moe_blocks(model):
        block.gate.weight = nn.Parameter(block.gate.weight.detach().float(), requires_grad=True)
        out.append(block.gate.weight)
    return out
