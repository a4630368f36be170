"""Expert LoRA exported per expert in 2-D (gate_proj, up_proj, down_proj): merged into transformers'
own float64 model (W_e + s·B·A per expert and projection), it gives fasttrain's logits with the
adapter, so the keys, the gate/up split and the scale are the ones a per-expert loader applies.
Tolerance as tests/moe/test_moe_models.py."""
import copy

import torch

from fasttrain.models.moe import moe_surgery
from fasttrain.models.moe_oracle import hf_routing
from fasttrain.models.moe_tiny import tiny_qwen3_moe
from fasttrain.nn import attach_adapters
from fasttrain.nn.moe_experts import moe_expert_layers
from fasttrain.nn.moe_export import moe_lora_per_expert


def test_per_expert_export_merged_into_the_transformers_model_gives_fasttrains_logits():
    hf = tiny_qwen3_moe(vocab_size=97, dtype=torch.float64)
    model = moe_surgery(copy.deepcopy(hf), nf4=False)
    torch.manual_seed(2)
    for p in attach_adapters(model, r=3, alpha=6.0, targets=["experts"]):
        torch.nn.init.normal_(p, std=0.2)
    t = moe_lora_per_expert(model)
    s = moe_expert_layers(model)[0][1].scale
    with torch.no_grad():
        for name, m in moe_expert_layers(model):
            ex = hf.get_submodule(name)
            for e in range(m.num_experts):
                d = {p: s * t[f"base_model.model.{name}.{e}.{p}.lora_B.weight"].double()
                     @ t[f"base_model.model.{name}.{e}.{p}.lora_A.weight"].double()
                     for p in ("gate_proj", "up_proj", "down_proj")}
                ex.gate_up_proj[e] += torch.cat([d["gate_proj"], d["up_proj"]])
                ex.down_proj[e] += d["down_proj"]
    ids = torch.tensor([[5, 9, 11, 40, 3, 7, 8, 60, 2, 33]])
    with torch.no_grad(), hf_routing(hf):
        want = hf(ids).logits
    with torch.no_grad():
        got = model(ids).logits
    c = hf.config
    tol = c.num_hidden_layers * (c.hidden_size + 2 * ids.shape[1] * 16) * 2.0**-53 * 1e3
    assert (want - got).abs().max() <= tol
    assert len(t) == 6 * sum(m.num_experts for _, m in moe_expert_layers(model))
