"""The family check every policy goes through, a folder's or a `module:factory`'s model alike:
is this a model one of fasttrain's families drives, layer by layer? One paragraph saying what was
found otherwise, before anything trains (never a traceback from inside the model's own code).

A model whose model_type names a family (models/families.py) must have that family's layer kinds
(a Llama-family checkpoint may also have sliding-window layers: the decoder refuses a sequence
longer than the window) and, if the family is not a mixture of experts, no routed experts. A model of another model_type
(a user's factory) is driven as a Llama-family model only when it has that shape: every layer a
self_attn with q/k/v/o projections and a dense MLP with gate/up/down projections, full attention
only, no experts. What is refused, with the reason named: another mixture of experts (Mixtral,
Qwen2-MoE, gpt-oss, ...), a layer kind no decoder of fasttrain runs (sliding-window attention,
state-space layers, ...), a model without .model.layers and .lm_head.

What this is not: a check of the weights' values or of the config's numbers (transformers' own).
"""
from __future__ import annotations

from torch import nn

from .families import FAMILIES, LLAMA, SUPPORTED_FAMILIES, Family

__all__ = ["check_drivable", "drivable_problem"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _family(model_type) -> Family | None:
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def _routed_experts(layer: nn.Module) -> str | None:
    """The class name of a layer's mixture-of-experts block, or None for a dense layer."""
    for _, mod in layer.named_modules():
        name = type(mod).__name__
        if hasattr(mod, "experts") or name.endswith(("MoeBlock", "MoE", "SparseMoeBlock", "Experts")):
            return name
    return None


def drivable_problem(model) -> str | None:
    """Why fasttrain cannot drive `model` (a *ForCausalLM or a PEFT wrapper of one), or None."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    cfg = getattr(model, "config", None)
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if cfg is None or layers is None or not hasattr(model, "lm_head"):
        return f"a {type(model).__name__} is not a causal LM with .model.layers and .lm_head"
    family = _family(getattr(cfg, "model_type", None))
    allowed = (family or LLAMA).layer_kinds
    if family is LLAMA:               # Qwen2/Qwen3 with use_sliding_window: the decoder checks the window
        allowed = allowed + ("sliding_attention",)
    kinds = list(getattr(cfg, "layer_types", None) or ["full_attention"] * len(layers))
    unknown = sorted(set(kinds) - set(allowed))
    if unknown:
        return (f"its layers include the kind(s) {', '.join(map(repr, unknown))}, which no decoder of fasttrain "
                f"runs (a {(family or LLAMA).name} model has {', '.join(map(repr, allowed))})")
    moe_ok = family is not None and getattr(family, "moe", False)
    for i, layer in enumerate(layers):
        experts = _routed_experts(layer)
        if experts is not None and not moe_ok:
            return (f"layer {i} is a mixture of experts ({experts}), and fasttrain drives the experts of "
                    "qwen3_moe and qwen3_5_moe models only")
        if family is None:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            missing = [n for n in _ATTENTION if not isinstance(getattr(attn, n, None), nn.Linear)]
            missing += [n for n in _MLP if not isinstance(getattr(mlp, n, None), nn.Linear)]
            if missing:
                return (f"layer {i} ({type(layer).__name__}) is not a Llama-family layer: it lacks the "
                        f"nn.Linear projection(s) {', '.join(missing)}")
    return None


def check_drivable(model, where: str) -> None:
    """A ValueError of one paragraph when fasttrain cannot drive `model` (see the module header)."""
    problem = drivable_problem(model)
    if problem is None:
        return
    cfg = getattr(getattr(model, "get_base_model", lambda: model)(), "config", None)
    mt = getattr(cfg, "model_type", None)
    raise ValueError(f"{where}: the model (model_type {mt!r}) is not one fasttrain drives: {problem}. fasttrain "
                     f"trains {', '.join(SUPPORTED_FAMILIES)} models, and a factory's model of another type when "
                     "it is Llama-shaped (self_attn with q/k/v/o_proj, a dense gate/up/down_proj MLP, full "
                     "attention only).")
