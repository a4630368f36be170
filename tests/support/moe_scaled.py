"""The bundled mixtures of experts (qwen3-30b-a3b, qwen3.5-35b-a3b) at small widths, for plans and
CPU steps that take seconds (tests/plan/test_moe_time.py, bench/bench_planned_time.py --moe).

Each keeps its bundled config's family and layer layout (Qwen3.5-MoE: a gated attention layer every
4th, the rest Gated DeltaNet), its top-k, its query heads per KV head, its value heads per key head
and its widths relative to hidden (experts, shared expert, head dims), at hidden SIZE["hidden"],
SIZE["layers"] layers (0: 2 for Qwen3-MoE, one attention interval for Qwen3.5-MoE) and at most
SIZE["experts"] experts (at least k), built by fasttrain.models.moe_tiny (random, seeded, routers
spread so that the top-k separate) over tiny_world's byte tokenizer (259 ids).
"""
from __future__ import annotations

import torch

SIZE = {"hidden": 128, "layers": 0, "experts": 16}


def scaled_moe(name: str, dtype: str = "float32", hidden: int | None = None, layers: int | None = None,
               experts: int | None = None, top_k: int | None = None, width: float = 1.0):
    """The bundled `name` at small width (see the header); top_k and width (a factor on the experts'
    width) vary the routed experts for the plan's tests. A transformers model in `dtype`."""
    from fasttrain.models.moe_tiny import tiny_qwen3_5_moe, tiny_qwen3_moe
    from fasttrain.plan import model_config

    c = model_config(name)
    H = hidden or SIZE["hidden"]
    s = H / c["hidden_size"]
    k = top_k or c["num_experts_per_tok"]
    E = min(c["num_experts"], max(k, experts or SIZE["experts"]))
    I = max(8, round(c["moe_intermediate_size"] * s * width))
    g = c["num_attention_heads"] // c["num_key_value_heads"]
    L = layers if layers is not None else SIZE["layers"]
    dt = getattr(torch, dtype)
    if c["model_type"] == "qwen3_moe":
        return tiny_qwen3_moe(vocab_size=259, hidden=H, layers=L or 2, heads=g, kv_heads=1, experts=E, top_k=k,
                              moe_intermediate=I, mlp_only_layers=tuple(c.get("mlp_only_layers") or ()),
                              norm_topk_prob=c["norm_topk_prob"], dtype=dt)
    interval = c["full_attention_interval"]
    return tiny_qwen3_5_moe(vocab_size=259, hidden=H, layers=L or interval, interval=interval, heads=g, kv_heads=1,
                            head_dim=max(8, round(c["head_dim"] * s)),
                            linear_k_heads=max(1, round(c["linear_num_key_heads"] * s)),
                            value_heads_per_key=c["linear_num_value_heads"] // c["linear_num_key_heads"],
                            linear_head_dim=max(8, round(c["linear_key_head_dim"] * s)), experts=E, top_k=k,
                            moe_intermediate=I, shared_intermediate=max(8, round(c["shared_expert_intermediate_size"] * s)),
                            dtype=dt)


def qwen3_30b_a3b_policy(dtype: str = "float32"):
    """(model, tokenizer) for a recipe's policy.model = "support.moe_scaled:qwen3_30b_a3b_policy"."""
    from support.tiny_world import ByteTokenizer
    return scaled_moe("qwen3-30b-a3b", dtype), ByteTokenizer()


def qwen3_5_35b_a3b_policy(dtype: str = "float32"):
    """(model, tokenizer) for a recipe's policy.model = "support.moe_scaled:qwen3_5_35b_a3b_policy"."""
    from support.tiny_world import ByteTokenizer
    return scaled_moe("qwen3.5-35b-a3b", dtype), ByteTokenizer()
