"""LoRA on the experts saved in PEFT's target_parameters format: PEFT 0.21 loads fasttrain's adapter
onto transformers' own float64 model and gives fasttrain's logits; the saved keys and the lora_B
layout are the ones PEFT writes (expert e's B is B[:, e::E]), checked by name; fasttrain loads the
file back exactly. Tolerance as tests/models/test_moe_models.py (float64, rounding order only); PEFT
adds W + s·B·A in float64 where fasttrain keeps the factors apart, which that bound covers."""
import copy
from contextlib import ExitStack

import pytest
import torch
from safetensors.torch import load_file

from fasttrain.models.moe import moe_surgery
from fasttrain.models.moe_tiny import tiny_qwen3_5_moe, tiny_qwen3_moe
from fasttrain.nn import adaptable_model, attach_adapters, load_adapter, save_adapter
from fasttrain.nn.moe_experts import moe_expert_layers

from support.hf_oracle import hf_float64_oracle
from support.moe_oracle import hf_routing
from support.tolerances import forward_tol

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)

FAMILIES = {"qwen3_moe": tiny_qwen3_moe, "qwen3_5_moe": tiny_qwen3_5_moe}
TARGETS = ("q_proj", "v_proj", "o_proj", "experts")


def _adapted(family):
    hf = FAMILIES[family](vocab_size=97, dtype=torch.float64)
    model = moe_surgery(copy.deepcopy(hf), nf4=False)
    adaptable_model(model, targets=("q_proj", "v_proj", "o_proj"))
    torch.manual_seed(1)
    for p in attach_adapters(model, r=3, alpha=6.0, targets=TARGETS):
        if p.dim() == 3 or p.shape[1] == 3:                        # the B factors: not zero, so they act
            torch.nn.init.normal_(p, std=0.2)
    return hf, model


def _logits(model, ids, hf=False):
    """transformers' forward of `model` (its delta rule and conv by the float64 reference); the
    routers of transformers' own model in float64."""
    with ExitStack() as st, torch.no_grad():
        if model.config.model_type.startswith("qwen3_5"):
            st.enter_context(hf_float64_oracle("qwen3_5_moe"))
        if hf:
            st.enter_context(hf_routing(model))
        return model(ids).logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_loads_the_expert_adapter_on_the_transformers_model_with_equal_logits(family, tmp_path):
    from peft import PeftModel
    hf, model = _adapted(family)
    save_adapter(model, tmp_path / "a")
    peft = PeftModel.from_pretrained(hf, tmp_path / "a").to(torch.float64)   # PEFT runs LoRA in its weights' dtype
    ids = torch.tensor([[5, 9, 11, 40, 3, 7, 8, 60, 2, 33]])
    want, got = _logits(peft, ids, hf=True), _logits(model, ids)
    c = hf.config
    tol = forward_tol(c, ids.shape[1], head_dim=16)
    assert (want - got).abs().max() <= tol
    with torch.no_grad(), peft.disable_adapter():               # the adapter does act
        assert (_logits(peft, ids, hf=True) - got).abs().max() > 1e3 * tol


def test_saved_keys_and_the_lora_b_layout_by_name(tmp_path):
    _, model = _adapted("qwen3_moe")
    save_adapter(model, tmp_path / "a")
    t = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    name, ex = moe_expert_layers(model)[0]
    E, r = ex.num_experts, ex.r
    gate_up_b = t[f"base_model.model.{name}.base_layer.lora_B.weight"]        # [2I, r·E]
    down_a = t[f"base_model.model.{name}.lora_A.weight"]                       # [r·E, I]
    assert gate_up_b.shape == (2 * ex.intermediate, r * E) and down_a.shape == (r * E, ex.intermediate)
    for e in range(E):
        assert torch.equal(gate_up_b[:, e::E], ex.gate_up_lora_B[e].float())
        assert torch.equal(down_a[e * r:(e + 1) * r], ex.down_lora_A[e].float())
    _, fresh = _adapted("qwen3_moe")
    for _, m in moe_expert_layers(fresh):
        m.gate_up_lora_A = m.gate_up_lora_B = m.down_lora_A = m.down_lora_B = None
        m.adapter = None
    load_adapter(fresh, tmp_path / "a")
    for (_, a), (_, b) in zip(moe_expert_layers(model), moe_expert_layers(fresh)):
        for f in ("gate_up_lora_A", "gate_up_lora_B", "down_lora_A", "down_lora_B"):
            assert torch.equal(getattr(a, f).float(), getattr(b, f))
