"""The plan's time terms of each model family, by name (TIME_TERMS): which terms beyond a dense
transformer's a family's step takes. The projections, the attention and a hybrid's state math are
read off the model's shape for every family (fasttrain.plan.speed on paper, fasttrain.plan.host_speed
from measured rates); a mixture of experts adds its routed experts, fasttrain.plan.moe_speed: on
paper (active_params, expert_lora_flops, decode_expert_bytes, ASSUMPTION) and from fasttrain.ops.moe_experts'
measured rates (expert_rates, forward_seconds, train_seconds, decode_seconds, router_params, note).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from fasttrain.models.families import family_of_type
from fasttrain.plan import moe_speed
from fasttrain.plan.meta_model import ModelShape

__all__ = ["FamilyTime", "TIME_TERMS", "family_time"]


@dataclass(frozen=True)
class FamilyTime:
    experts: ModuleType | None = None     # the routed experts' time terms (fasttrain.plan.moe_speed); None: none


TIME_TERMS: dict[str, FamilyTime] = {
    "llama": FamilyTime(),
    "qwen3_5": FamilyTime(),
    "qwen3_moe": FamilyTime(experts=moe_speed),
    "qwen3_5_moe": FamilyTime(experts=moe_speed),
}


def family_time(m: ModelShape) -> FamilyTime:
    """The time terms of m's family (m.model_type names it)."""
    return TIME_TERMS[family_of_type(m.model_type, m.name).name]
