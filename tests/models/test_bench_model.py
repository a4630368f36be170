"""The pinned benchmark mixture of experts (fasttrain.models.bench_model.qwen3_moe_bench, the bundled
qwen3-moe-bench-100m config): the parameter count its shapes give, no load-balancing loss, and
fasttrain's policy builder taking it as a MoE: every layer's experts NF4 with LoRA per expert
beside the attention's four projections, the router frozen, gradients reaching the expert LoRA."""
import torch

from fasttrain.models.bench_model import MOE_BENCH_CONFIG, bench_config

FACTORY = "fasttrain.models.bench_model:qwen3_moe_bench"
RANK = 4


def _params(c) -> int:
    """Parameters of a Qwen3-MoE whose layers are all sparse: untied embeddings and head, per layer
    q/k/v/o with the q/k norms, the router and the E expert stacks [2I, H] and [H, I], two norms."""
    H, V, E, I = c.hidden_size, c.vocab_size, c.num_experts, c.moe_intermediate_size
    D, q, kv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    attention = H * q * D + 2 * H * kv * D + q * D * H + 2 * D
    layer = attention + E * H + E * 3 * I * H + 2 * H
    return 2 * V * H + c.num_hidden_layers * layer + H


def test_config_gives_its_parameter_count_and_no_aux_loss():
    from transformers import AutoModelForCausalLM
    c = bench_config(MOE_BENCH_CONFIG)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(c)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == _params(c) == 103_504_640
    assert c.router_aux_loss_coef == 0 and not c.output_router_logits
    assert c.decoder_sparse_step == 1 and not c.mlp_only_layers       # every layer sparse


def test_policy_builds_it_as_nf4_experts_with_lora():
    from fasttrain.models.moe import is_moe, moe_layers
    from fasttrain.nn.moe_experts import moe_blocks
    from fasttrain.train.config import load_config
    from fasttrain.train.policy import build_policy
    cfg = load_config({"policy": {"model": FACTORY, "dtype": "float32", "rank": RANK, "alpha": 2.0 * RANK},
                       "run": {"device": "cpu"}})
    model, tok, params = build_policy(cfg, torch.device("cpu"))
    c = model.config
    assert is_moe(model) and moe_layers(model) == list(range(c.num_hidden_layers))
    for _, b in moe_blocks(model):
        assert b.experts.nf4 and b.experts.adapter == "lora" and b.experts.r == RANK
        assert not b.gate.weight.requires_grad                                # the router stays frozen
        assert b.experts.gate_up_lora_A.shape == (c.num_experts, RANK, c.hidden_size)
    kinds = {n.split(".")[-2] + "." + n.split(".")[-1] for n in params}
    attention = {f"{p}.lora_{ab}" for p in ("q_proj", "k_proj", "v_proj", "o_proj") for ab in "AB"}
    experts = {f"experts.{s}_lora_{ab}" for s in ("gate_up", "down") for ab in "AB"}
    assert kinds == attention | experts and len(params) == c.num_hidden_layers * len(kinds)

    ids = torch.tensor([tok.encode("The benchmark model routes every token.")])
    model(ids, labels=ids).loss.backward()                                    # every expert LoRA A gets a gradient
    for _, b in moe_blocks(model):
        for ab in (b.experts.gate_up_lora_A, b.experts.down_lora_A):
            assert ab.grad is None or not ab.grad.any()                       # B = 0 at the start: no A gradient
        assert b.experts.gate_up_lora_B.grad.abs().sum() > 0 and b.experts.down_lora_B.grad.abs().sum() > 0
