"""fasttrain.rl — pure algorithm pieces (tensors in, tensors out; no model, no I/O).

    gdpo.gdpo_advantages(rewards [B,K], group_size, weights [K], batch_normalize) -> [B]
    guards.floor_guard(advantages [B], guarded [B], group_size) -> [B]   (Euclidean projection)
    guards.guarded_answers(core, valid, floor, guard_invalid) -> bool [B]
    guards.legacy_clamp(advantages, core) -> [B]                         (the seed's trap)
    masks.top_entropy_mask, repo_r.Thermostat                            (policy-loss issue)
"""
from fasttrain.rl.gdpo import gdpo_advantages, group_standardize
from fasttrain.rl.guards import floor_guard, guarded_answers, legacy_clamp, nonzero_share

__all__ = ["gdpo_advantages", "group_standardize", "floor_guard", "guarded_answers",
           "legacy_clamp", "nonzero_share"]
