"""Adapters on a Qwen3.5 hybrid in PEFT's format: LoRA and DoRA on every linear projection of both
layer kinds (Gated DeltaNet in_proj_qkv/z/b/a and out_proj, gated attention q/k/v/o_proj, the MLP),
saved by fasttrain, loaded by PEFT onto the float model holding the same (dequantised) base weights:
the same logits; and back through fasttrain's own loader bit for bit."""
import copy
import json

import peft
import pytest
import torch

from fasttrain.models import tiny_qwen3_5
from fasttrain.models.families import QWEN3_5
from fasttrain.nn import attach_adapters, load_adapter, quantize_model, save_adapter
from fasttrain.nn.nf4_linear import NF4Linear

from support.hf_oracle import hf_float64_oracle


def _float_copy(qmodel, like):
    ref = copy.deepcopy(like)
    for name, layer in qmodel.named_modules():
        if isinstance(layer, NF4Linear):
            with torch.no_grad():
                ref.get_submodule(name).weight.copy_(layer.dequantized_weight(torch.float64))
    return ref


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_peft_loads_our_hybrid_adapter_and_gives_the_same_logits(tmp_path, kind):
    float_model = tiny_qwen3_5(vocab_size=97, dtype=torch.float64, value_heads_per_key=3)
    model = quantize_model(copy.deepcopy(float_model), targets=QWEN3_5.projections)
    attach_adapters(model, kind, r=4, alpha=8, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, NF4Linear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)
                if m.lora_magnitude is not None:
                    m.lora_magnitude.mul_(1 + 0.1 * torch.rand(m.lora_magnitude.shape, generator=g))
    save_adapter(model, tmp_path, base_model="tiny-hybrid")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert set(cfg["target_modules"]) == set(QWEN3_5.projections) and cfg["use_dora"] == (kind == "dora")
    ref = peft.PeftModel.from_pretrained(_float_copy(model, float_model), tmp_path).eval()
    ids = torch.randint(3, 97, (2, 9), generator=g)
    with torch.no_grad(), hf_float64_oracle():
        ours, theirs = model(ids).logits, ref(ids).logits
        base = float_model(ids).logits
    assert (ours - base).abs().max() > 1e-2                     # the adapters change the output
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
    model2 = quantize_model(copy.deepcopy(float_model), targets=QWEN3_5.projections)
    load_adapter(model2, tmp_path)
    with torch.no_grad(), hf_float64_oracle():
        torch.testing.assert_close(model2(ids).logits, ours, rtol=0, atol=0)
