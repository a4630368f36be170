"""The routed experts in the layouts serving stacks load: the expert LoRA as vLLM's MoE LoRA loader
reads it, and the merged experts under the released checkpoint's names. `fasttrain export`
(fasttrain.train.export) calls both.

    vllm_expert_lora(tensors, r, fused=False)      # PEFT target_parameters tensors -> vLLM's keys
    merged_expert_tensors(experts, prefix, dtype, fused=False)   # (name, tensor), one at a time

vLLM's loader, as read in vLLM's source (main branch, 2026-12: vllm/lora/model_manager.py at commit
01533aa, `_stack_moe_lora_weights` and `_create_merged_loras_inplace`; vllm/lora/lora_model.py;
vllm/model_executor/models/qwen3_5.py at commit 00def4f; qwen3_moe.py), takes one of two layouts,
chosen by the model class's `is_3d_moe_weight`:
  2-D (the default: Qwen3MoeForCausalLM, and Qwen3_5MoeForCausalLM, the text-only class)
      <experts>.<e>.gate_proj.lora_A.weight [r, H]   .lora_B.weight [I, r]
      <experts>.<e>.up_proj.lora_A.weight   [r, H]   .lora_B.weight [I, r]
      <experts>.<e>.down_proj.lora_A.weight [r, I]   .lora_B.weight [H, r]
    packed per expert into its w1/w2/w3 stacks (fused_moe_make_expert_params_mapping's names);
  3-D (Qwen3_5MoeForConditionalGeneration sets is_3d_moe_weight = True)
      <experts>.base_layer.lora_A.weight [r·E, H]   .lora_B.weight [2I, r·E]   gate_up_proj
      <experts>.lora_A.weight            [r·E, I]   .lora_B.weight [H, r·E]    down_proj
    which is PEFT's target_parameters file exactly: vLLM reshapes lora_A to (E, r, in) and lora_B to
    (out, r, E) then permutes it to (E, out, r) (fasttrain.nn.moe_peft.from_peft is the same map),
    and splits gate_up's output rows in halves, gate first.
fasttrain's gate_up factor of expert e is A_e [r, H], B_e [2I, r] (gate rows first); as separate
projections gate_proj and up_proj both take A_e, with B_e[:I] and B_e[I:]: the same product split
by rows, exact. The scale stays α/r (α/√r with rsLoRA), so the adapter_config.json of the dense
projections holds for these keys too.

The merged experts: W_e + s·B_e·A_e per expert (MoEExperts.merged_expert: fp32, rounded once), under
the source checkpoint's layout: per expert (`<experts>.<e>.{gate,up,down}_proj.weight`, how
transformers saves both families and how Qwen3-MoE is released) or fused (`<experts>.gate_up_proj`
[E, 2I, H], `<experts>.down_proj` [E, H, I], how Qwen3.5-MoE is released). Both load in
transformers 5 and in vLLM's loaders of the two families.
"""
from __future__ import annotations

import re

import torch

from fasttrain.nn.moe_experts import MoEExperts
from fasttrain.nn.moe_peft import from_peft

__all__ = ["vllm_expert_lora", "merged_expert_tensors", "is_expert_lora_key"]

_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(base_layer\.)?lora_([AB])\.weight$")


def is_expert_lora_key(key: str) -> bool:
    """Whether an adapter tensor key is one of PEFT's target_parameters expert factors."""
    return _EXPERT_KEY.match(key) is not None


def vllm_expert_lora(tensors: dict[str, torch.Tensor], r: int, fused: bool = False) -> dict[str, torch.Tensor]:
    """The expert factors among `tensors` (PEFT's target_parameters keys, see fasttrain.nn.moe_peft) in
    vLLM's layout (the module header): as they are for the 3-D layout (`fused`), else per expert 2-D.
    Other keys are left out."""
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        m = _EXPERT_KEY.match(k)
        if m:
            stack = "gate_up" if m.group(2) else "down"
            experts.setdefault(m.group(1), {})[f"{stack}_{m.group(3)}"] = v
    if fused:
        return {k: v.contiguous() for k, v in tensors.items() if is_expert_lora_key(k)}
    out: dict[str, torch.Tensor] = {}
    for path, f in experts.items():
        E = f["down_A"].shape[0] // r
        a_gu, b_gu = from_peft(f["gate_up_A"], f["gate_up_B"], E)
        a_d, b_d = from_peft(f["down_A"], f["down_B"], E)
        inter = b_gu.shape[1] // 2
        for e in range(E):
            parts = {"gate_proj": (a_gu[e], b_gu[e, :inter]), "up_proj": (a_gu[e], b_gu[e, inter:]),
                     "down_proj": (a_d[e], b_d[e])}
            for proj, (a, b) in parts.items():
                out[f"{path}.{e}.{proj}.lora_A.weight"] = a.clone(memory_format=torch.contiguous_format)
                out[f"{path}.{e}.{proj}.lora_B.weight"] = b.clone(memory_format=torch.contiguous_format)
    return out


def merged_expert_tensors(experts: MoEExperts, prefix: str, dtype: torch.dtype, fused: bool = False):
    """(name, merged tensor) of one layer's routed experts under `prefix` (`...mlp.experts.`), fused
    stacks or per expert (the module header), each computed when it is yielded."""
    if fused:
        yield prefix + "gate_up_proj", experts.merged_stack("gate_up", dtype)
        yield prefix + "down_proj", experts.merged_stack("down", dtype)
        return
    inter = experts.intermediate
    for e in range(experts.num_experts):
        gu = experts.merged_expert("gate_up", e, dtype)
        yield f"{prefix}{e}.gate_proj.weight", gu[:inter].contiguous()
        yield f"{prefix}{e}.up_proj.weight", gu[inter:].contiguous()
        yield f"{prefix}{e}.down_proj.weight", experts.merged_expert("down", e, dtype)
