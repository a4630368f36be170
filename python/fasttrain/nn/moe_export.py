"""Expert LoRA in the per-expert 2-D layout an inference engine's MoE LoRA loader reads (vLLM's
FusedMoEWithLoRA takes `experts.<e>.{gate,up,down}_proj.lora_{A,B}.weight`), for the export command
to call next to the dense projections' tensors.

    tensors = moe_lora_per_expert(model)      # {key: fp32 tensor}, PEFT-style keys, 2-D per expert

fasttrain's gate_up factor of expert e is A_e [r, H] and B_e [2I, r] (gate rows first); as separate
projections gate_proj and up_proj both take A_e, with B_e[:I] and B_e[I:] (exact: the same product
split by rows). down_proj takes A_e [r, I] and B_e [H, r]. The scale stays α/r (α/√r with rsLoRA),
so an adapter_config.json written for the dense projections holds for these keys too.
What it is not: vLLM's fused 3-D layout (Qwen3.5-MoE checkpoints loaded with is_3d_moe_weight),
which is not written yet.
"""
from __future__ import annotations

import torch
from torch import nn

from fasttrain.nn.moe_experts import moe_expert_layers

__all__ = ["moe_lora_per_expert"]


def moe_lora_per_expert(model: nn.Module, prefix: str = "base_model.model.") -> dict[str, torch.Tensor]:
    """The expert adapters of `model` as per-expert 2-D LoRA tensors (fp32, CPU); see the header."""
    out: dict[str, torch.Tensor] = {}
    for name, m in moe_expert_layers(model):
        if m.adapter is None:
            continue
        I = m.intermediate
        for e in range(m.num_experts):
            a_gu, b_gu = m.gate_up_lora_A[e].detach(), m.gate_up_lora_B[e].detach()
            parts = {"gate_proj": (a_gu, b_gu[:I]), "up_proj": (a_gu, b_gu[I:]),
                     "down_proj": (m.down_lora_A[e].detach(), m.down_lora_B[e].detach())}
            for proj, (a, b) in parts.items():
                key = f"{prefix}{name}.{e}.{proj}"
                out[f"{key}.lora_A.weight"] = a.float().contiguous().cpu()
                out[f"{key}.lora_B.weight"] = b.float().contiguous().cpu()
    return out
